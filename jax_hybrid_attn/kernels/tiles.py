"""Query tiles: which tokens of which request each CTA row block holds, and the packing around the kernel.

A tile of `rows` wgmma rows holds consecutive query tokens of one request, ``64 // G`` per 64-row
warpgroup block; row ``g * (64 // G) + j`` of a block is its token j, query head ``h * G + g`` of KV head h (each
head's rows together, so that a head's block is one strided copy of q; when G does not divide 64 the last rows
are padding). Requests whose whole query fits one 64-row tile are decode tiles (one per request, keys split
across CTAs); longer queries are cut into prefill tiles of 128 rows (two consumer warpgroups). Both tables have static sizes (a bound from R and T),
so building them needs no host round trip; unused tiles have length 0.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._compat import register_pytree_dataclass
from ..integers import cdiv
from ..metadata import token_requests
from ..softmax_merge import merge_splits
from .config import ROWS

__all__ = [
    "ROWS",
    "QueryTiles",
    "Requests",
    "decode_tiles",
    "prefill_tiles",
    "prefill_tiles_per_request",
    "tile_rows",
    "pack_query_rows",
    "merge_splits",
    "prefill_token_rows",
    "token_outputs",
    "token_parts",
]


class Requests(NamedTuple):
    """The batch's requests as the kernels see them."""

    query_start_loc: Int[Array, "R+1"]
    query_lens: Int[Array, "R"]
    seq_lens: Int[Array, "R"]  # keys of each request; 0: none (its tokens' output is 0)
    block_tables: Int[Array, "R P"]  # every entry a block of the pool
    flagged: Bool[Array, "R"]  # requests that cannot be served: their tokens come out NaN


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    request: Int[Array, "NT"]  # request of each tile
    query_start: Int[Array, "NT"]  # offset of the tile's first token within its request's query
    query_len: Int[Array, "NT"]  # tokens in the tile; 0 for an idle tile


register_pytree_dataclass(QueryTiles, data_fields=["request", "query_start", "query_len"], meta_fields=[])


def tokens_per_tile(group_size: int, rows: int = ROWS) -> int:
    """Query tokens one tile of `rows` rows holds: ``64 // G`` tokens of G heads per 64-row warpgroup."""
    return rows // ROWS * (ROWS // group_size)


def decode_tiles(query_lens: Int[Array, "R"], group_size: int) -> QueryTiles:
    """One 64-row tile per request whose query fits it; longer requests get an idle tile."""
    fits = query_lens <= tokens_per_tile(group_size)
    num_reqs = query_lens.shape[0]
    return QueryTiles(
        request=jnp.arange(num_reqs, dtype=jnp.int32),
        query_start=jnp.zeros(num_reqs, jnp.int32),
        query_len=jnp.where(fits, query_lens, 0).astype(jnp.int32),
    )


def prefill_tiles_per_request(
    query_lens: Int[Array, "R"], group_size: int, *, rows: int, tiled: Bool[Array, "R"] | None = None
) -> Int[Array, "R"]:
    """Tiles of `rows` rows each request takes: those of `tiled`, by default the requests whose query does not fit
    one decode tile."""
    if tiled is None:
        tiled = query_lens > tokens_per_tile(group_size)
    return jnp.where(tiled, cdiv(query_lens, tokens_per_tile(group_size, rows)), 0)


def prefill_tiles(
    query_lens: Int[Array, "R"], group_size: int, num_tokens: int, *, rows: int, tiled: Bool[Array, "R"] | None = None
) -> QueryTiles:
    """Tiles of `tokens_per_tile` tokens over the requests of `tiled` (`prefill_tiles_per_request`).

    The table has ``R + T // tokens_per_tile`` entries, enough for any lengths summing to T."""
    per_tile = tokens_per_tile(group_size, rows)
    num_reqs = query_lens.shape[0]
    tiles_per_request = prefill_tiles_per_request(query_lens, group_size, rows=rows, tiled=tiled)
    ends = jnp.cumsum(tiles_per_request)
    index = jnp.arange(num_reqs + num_tokens // per_tile, dtype=jnp.int32)
    # loop-free (see `metadata.token_requests`)
    request = jnp.minimum(jnp.searchsorted(ends, index, side="right", method="compare_all"), num_reqs - 1)
    request = request.astype(jnp.int32)
    local = index - (ends[request] - tiles_per_request[request])
    query_start = local * per_tile
    query_len = jnp.where(index < ends[-1], jnp.clip(query_lens[request] - query_start, 0, per_tile), 0)
    return QueryTiles(
        request=request, query_start=query_start.astype(jnp.int32), query_len=query_len.astype(jnp.int32)
    )


def tile_rows(
    tiles: QueryTiles, query_start_loc, *, group_size: int, num_kv_heads: int, num_tokens: int, rows: int
):
    """Token [NT, rows] and query head [K, rows] of each row; rows past a tile's tokens, and padding rows, get
    token T."""
    per_block = ROWS // group_size
    row = jnp.arange(rows)
    g, j = row % ROWS // per_block, row % ROWS % per_block
    offset = row // ROWS * per_block + j
    tokens = jnp.where(
        (g < group_size) & (offset < tiles.query_len[:, None]),
        query_start_loc[tiles.request][:, None] + tiles.query_start[:, None] + offset,
        num_tokens,
    )
    heads = jnp.arange(num_kv_heads)[:, None] * group_size + jnp.minimum(g, group_size - 1)
    return tokens, heads


def pack_query_rows(q: Float[Array, "T N H"], tokens, heads) -> Float[Array, "NT K rows H"]:
    return q.at[tokens[:, None, :], heads[None, :, :]].get(mode="fill", fill_value=0)


def _token_states(requests: Requests, num_actual_tokens, num_tokens: int):
    """Each token's request [T] and offset in its request's query [T], whether its request's tile holds it (a
    request that is not flagged) [T], and the value of a token no tile holds [T]: NaN before `num_actual_tokens`,
    0 (padding) from there on."""
    token = jnp.arange(num_tokens)
    request = token_requests(requests.query_start_loc, token)
    offset = token - requests.query_start_loc[request]
    held = (offset >= 0) & (offset < requests.query_lens[request]) & ~requests.flagged[request]
    return request, offset, held, jnp.where(token < num_actual_tokens, jnp.nan, 0.0)


def prefill_token_rows(
    prefill: tuple[Float[Array, "NT K 1 rows H"], Float[Array, "NT K 1 rows"]],
    requests: Requests,
    num_actual_tokens: Int[Array, ""],
    sinks: Float[Array, "N"] | None,
    v_scale: Float[Array, ""],
    *,
    group_size: int,
    num_tokens: int,
    dtype,
) -> Float[Array, "T N H"]:
    """Each token's output (v scale applied, in `dtype`) gathered from its prefill tile's partial output and
    log-sum-exp (one split: the merge only adds the sinks and fuses into the gather); NaN for the tokens of
    flagged requests and those no request holds, 0 for padding. Decode requests' tokens get arbitrary rows
    (`token_outputs` writes them)."""
    partial_out, lse = prefill
    request, offset, held, fill = _token_states(requests, num_actual_tokens, num_tokens)
    index = _prefill_rows_index(partial_out.shape, requests, request, offset, group_size=group_size)
    out = merge_splits(partial_out[index], lse[index], sinks) * v_scale
    return jnp.where(held[:, None, None], out, fill[:, None, None]).astype(dtype)


def _prefill_rows_index(shape, requests: Requests, request, offset, *, group_size: int) -> tuple:
    """The index that takes each token's rows [T, N, splits, ...] out of a prefill launch's partials of `shape`
    [NT, K, splits, rows, H], from the tokens' requests [T] and offsets in their queries [T]."""
    num_tiles, num_kv_heads, _, rows = shape[:4]
    head = jnp.arange(num_kv_heads * group_size)
    per_block, per_tile = ROWS // group_size, tokens_per_tile(group_size, rows)
    tiles_per_request = prefill_tiles_per_request(requests.query_lens, group_size, rows=rows)
    first_tile = jnp.cumsum(tiles_per_request) - tiles_per_request
    tile = jnp.clip(first_tile[request] + offset // per_tile, 0, num_tiles - 1)
    in_tile = offset % per_tile
    row = (in_tile // per_block * ROWS + in_tile % per_block)[:, None] + (head % group_size * per_block)[None, :]
    return tile[:, None], (head // group_size)[None, :], slice(None), row


def token_outputs(
    decode: tuple[Float[Array, "R K S rows H"], Float[Array, "R K S rows"]],
    prefill_rows: Float[Array, "T N H"] | None,
    requests: Requests,
    num_actual_tokens: Int[Array, ""],
    sinks: Float[Array, "N"] | None,
    v_scale: Float[Array, ""],
    *,
    group_size: int,
    num_tokens: int,
    dtype,
) -> Float[Array, "T N H"]:
    """Each token's output in `dtype`. With `prefill_rows` (the prefill launch's output per token, complete for
    every token but those of decode requests: v scale applied, flagged and padding tokens filled, in `dtype`), the
    decode tiles' tokens (`decode_tiles`: the partial outputs and log-sum-exps of `launch.launch_attention`) are
    written into it, in place: a scatter of at most ``64 // G`` tokens per request, no pass over all T tokens.
    Without (a batch of decodes, T small), one gather over the tokens. NaN flags the tokens of flagged requests
    and those no tile holds (a prefill token without a prefill launch); padding tokens (from `num_actual_tokens`
    on) get zeros.

    Decode tiles are merged over their splits where they are ([R, K, rows, H], small), not per token. Their rows
    are 64 (the tile kernel's) or the narrow decode kernel's C columns, ``rows // G`` tokens per head."""
    decode_out, decode_lse = decode
    num_reqs, num_kv_heads, _, rows = decode_out.shape[:4]
    num_q_heads = num_kv_heads * group_size
    per_block = rows // group_size  # tokens per decode tile
    row_g = jnp.minimum(jnp.arange(rows) // per_block, group_size - 1)  # padding rows: any head
    row_heads = jnp.arange(num_kv_heads)[:, None] * group_size + row_g[None, :]  # [K, rows]
    decode_rows = merge_splits(  # [R, K, rows, H]
        jnp.moveaxis(decode_out, 2, -2), jnp.moveaxis(decode_lse, 2, -1), None if sinks is None else sinks[row_heads]
    )
    head = jnp.arange(num_q_heads)

    def decode_values(request, j):  # [...] requests and token offsets -> their decode rows [..., N, H]
        rows = (head % group_size * per_block) + j[..., None]
        return decode_rows[request[..., None], head // group_size, rows] * v_scale

    query_start_loc, query_lens, flagged = requests.query_start_loc, requests.query_lens, requests.flagged
    is_decode = query_lens <= per_block
    if prefill_rows is None:
        request, offset, held, fill = _token_states(requests, num_actual_tokens, num_tokens)
        held &= is_decode[request]
        out = decode_values(request, jnp.where(held, offset, 0))
        return jnp.where(held[:, None, None], out, fill[:, None, None]).astype(dtype)

    j = jnp.arange(per_block)  # a decode tile's j-th token
    token = query_start_loc[:-1, None] + j  # [R, rows/G]
    values = decode_values(jnp.arange(num_reqs)[:, None], j[None, :])  # [R, rows/G, N, H]
    values = jnp.where(flagged[:, None, None, None], jnp.nan, values)
    values = jnp.where((token < num_actual_tokens)[..., None, None], values, 0.0).astype(dtype)
    target = jnp.where(is_decode[:, None] & (j[None, :] < query_lens[:, None]), token, num_tokens)  # T: dropped
    return prefill_rows.at[target.reshape(-1)].set(values.reshape(-1, *prefill_rows.shape[1:]), mode="drop")


def token_parts(
    decode: tuple[Float[Array, "R K S rows H"], Float[Array, "R K S rows"]],
    prefill: tuple[Float[Array, "NT K S rows H"], Float[Array, "NT K S rows"]] | None,
    requests: Requests,
    num_actual_tokens: Int[Array, ""],
    v_scale: Float[Array, ""],
    *,
    group_size: int,
    num_tokens: int,
) -> tuple[Float[Array, "T N H"], Float[Array, "T N"]]:
    """Each token's attention as a part to merge (`softmax_merge.merge_splits`), without sinks: (its output over
    the keys it saw, v scale applied, float32; the log-sum-exp of their logits, -inf where none). From the decode
    tiles for decode requests, from the prefill tiles for the others (each with its key splits merged). NaN for
    the tokens of flagged requests and those no tile holds; padding tokens get output 0 and log-sum-exp -inf."""
    decode_out, decode_lse = decode
    num_kv_heads = decode_out.shape[1]
    per_block = ROWS // group_size
    head = jnp.arange(num_kv_heads * group_size)
    request, offset, held, fill = _token_states(requests, num_actual_tokens, num_tokens)
    is_decode = requests.query_lens[request] <= per_block

    rows_lse = jax.nn.logsumexp(decode_lse, axis=2)  # over the splits: [R, K, rows]; -inf where none saw a key
    rows_out = merge_splits(jnp.moveaxis(decode_out, 2, -2), jnp.moveaxis(decode_lse, 2, -1), None)  # [R, K, rows, H]
    rows = head % group_size * per_block + jnp.where(is_decode, offset, 0)[:, None]  # [T, N]
    out = rows_out[request[:, None], head // group_size, rows]
    lse = rows_lse[request[:, None], head // group_size, rows]
    if prefill is not None:
        partial_out, partial_lse = prefill
        index = _prefill_rows_index(partial_out.shape, requests, request, offset, group_size=group_size)
        token_out, token_lse = partial_out[index], partial_lse[index]  # [T, N, splits, H], [T, N, splits]
        out = jnp.where(is_decode[:, None, None], out, merge_splits(token_out, token_lse, None))
        lse = jnp.where(is_decode[:, None], lse, jax.nn.logsumexp(token_lse, axis=-1))
    held &= is_decode | (prefill is not None)
    out = jnp.where(held[:, None, None], out * v_scale, fill[:, None, None])
    lse = jnp.where(held[:, None], lse, jnp.where(jnp.isnan(fill), jnp.nan, -jnp.inf)[:, None])
    return out, lse
