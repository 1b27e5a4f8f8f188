"""Query tiles: which tokens of which request each CTA row block holds, and the packing around the kernel.

A tile of `rows` wgmma rows holds consecutive query tokens of one request, ``64 // G`` per 64-row
warpgroup block; row ``g * (64 // G) + j`` of a block is its token j, query head ``h * G + g`` of KV head h (each
head's rows together, so that a head's block is one strided copy of q; when G does not divide 64 the last rows
are padding). Requests whose whole query fits one
64-row tile are decode tiles (one per request, keys split across CTAs); longer queries are cut into
prefill tiles of 128 rows (two consumer warpgroups). Both tables have static sizes (a bound from R and T),
so building them needs no host round trip; unused tiles have length 0.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._compat import register_pytree_dataclass
from ..integers import cdiv
from ..metadata import token_requests
from .config import ROWS

__all__ = [
    "ROWS",
    "QueryTiles",
    "decode_tiles",
    "prefill_tiles",
    "prefill_tiles_per_request",
    "tile_rows",
    "pack_query_rows",
    "merge_splits",
    "prefill_token_rows",
    "token_outputs",
]


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


def prefill_tiles_per_request(query_lens: Int[Array, "R"], group_size: int, *, rows: int) -> Int[Array, "R"]:
    """Prefill tiles of `rows` rows each request takes: none for a query that fits one decode tile."""
    is_prefill = query_lens > tokens_per_tile(group_size)
    return jnp.where(is_prefill, cdiv(query_lens, tokens_per_tile(group_size, rows)), 0)


def prefill_tiles(query_lens: Int[Array, "R"], group_size: int, num_tokens: int, *, rows: int) -> QueryTiles:
    """Tiles of `tokens_per_tile` tokens over the requests whose query does not fit one decode tile.

    The table has ``R + T // tokens_per_tile`` entries, enough for any lengths summing to T."""
    per_tile = tokens_per_tile(group_size, rows)
    num_reqs = query_lens.shape[0]
    tiles_per_request = prefill_tiles_per_request(query_lens, group_size, rows=rows)
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


def merge_splits(partial_out, lse, sinks):
    """Combine splits: [..., splits, H] with lse [..., splits] -> [..., H] float32.

    `sinks` (broadcastable to lse's leading axes, or None) adds one unscaled logit per head to the softmax
    denominator only."""
    lse_max = lse.max(axis=-1)
    if sinks is not None:
        lse_max = jnp.maximum(lse_max, sinks)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lse - lse_max[..., None])  # [..., splits]
    denominator = weights.sum(axis=-1)
    if sinks is not None:
        denominator = denominator + jnp.exp(sinks - lse_max)
    out = (weights[..., None] * partial_out.astype(jnp.float32)).sum(axis=-2)
    return out / jnp.where(denominator > 0, denominator, 1.0)[..., None]


def _token_rows(query_start_loc, num_tokens: int, num_q_heads: int, group_size: int):
    """Each token [T], its request [T] and its offset in its request's query [T], each head's KV head [N], and a
    function from a token's offset within its tile [T] to the row of each of its heads there [T, N]."""
    token = jnp.arange(num_tokens)
    request = token_requests(query_start_loc, token)
    offset = token - query_start_loc[request]
    head = jnp.arange(num_q_heads)
    per_block = ROWS // group_size  # tokens per 64-row warpgroup block

    def row_of(offset_in_tile):
        block, j = offset_in_tile // per_block, offset_in_tile % per_block
        return (block * ROWS + j)[:, None] + (head % group_size * per_block)[None, :]

    return token, request, offset, head // group_size, row_of


def prefill_token_rows(
    prefill: tuple[Float[Array, "NT K 1 rows H"], Float[Array, "NT K 1 rows"]],
    query_start_loc: Int[Array, "R+1"],
    query_lens: Int[Array, "R"],
    sinks: Float[Array, "N"] | None,
    *,
    group_size: int,
    num_tokens: int,
) -> Float[Array, "T N H"]:
    """Each token's output (float32) gathered from its prefill tile's partial output and log-sum-exp (one split:
    the merge only adds the sinks and fuses into the gather). Tokens of other requests get arbitrary rows."""
    partial_out, lse = prefill
    num_q_heads = partial_out.shape[1] * group_size
    _, request, offset, kv_head, row_of = _token_rows(query_start_loc, num_tokens, num_q_heads, group_size)
    per_tile = tokens_per_tile(group_size, partial_out.shape[3])
    tiles_per_request = prefill_tiles_per_request(query_lens, group_size, rows=partial_out.shape[3])
    first_tile = jnp.cumsum(tiles_per_request) - tiles_per_request
    tile = jnp.clip(first_tile[request] + offset // per_tile, 0, partial_out.shape[0] - 1)
    index = (tile[:, None], kv_head[None, :], slice(None), row_of(offset % per_tile))  # -> [T, N, 1, ...]
    return merge_splits(partial_out[index], lse[index], sinks)


def token_outputs(
    decode: tuple[Float[Array, "R K S rows H"], Float[Array, "R K S rows"]],
    prefill_rows: Float[Array, "T N H"] | None,
    query_start_loc: Int[Array, "R+1"],
    query_lens: Int[Array, "R"],
    flagged: Bool[Array, "R"],
    num_actual_tokens: Int[Array, ""],
    sinks: Float[Array, "N"] | None,
    *,
    group_size: int,
    num_tokens: int,
) -> Float[Array, "T N H"]:
    """Each token's output (float32): from its request's decode tile (`decode_tiles`: the partial outputs and
    log-sum-exps of `launch.launch_attention`, merged over the splits by `merge_splits`), or from `prefill_rows`
    (the prefill launch's output per token, None where that launch was skipped). Padding tokens (from
    `num_actual_tokens` on) get zeros. NaN flags the tokens of `flagged` requests and those no tile holds (a
    prefill token without a prefill launch).

    Decode tiles are merged over their splits where they are ([R, K, 64, H], small) and then gathered per token:
    every token reads its request's decode row, so merging after the gather would repeat the splits' sum for
    each of T tokens."""
    decode_out, decode_lse = decode
    num_kv_heads = decode_out.shape[1]
    token, request, offset, kv_head, row_of = _token_rows(
        query_start_loc, num_tokens, num_kv_heads * group_size, group_size
    )
    per_block = ROWS // group_size
    row_g = jnp.minimum(jnp.arange(ROWS) // per_block, group_size - 1)  # padding rows: any head
    row_heads = jnp.arange(num_kv_heads)[:, None] * group_size + row_g[None, :]  # [K, 64]
    decode_rows = merge_splits(  # [R, K, 64, H]
        jnp.moveaxis(decode_out, 2, -2), jnp.moveaxis(decode_lse, 2, -1), None if sinks is None else sinks[row_heads]
    )
    held = (offset >= 0) & (offset < query_lens[request]) & ~flagged[request]
    is_decode = query_lens[request] <= tokens_per_tile(group_size)
    out = decode_rows[request[:, None], kv_head[None, :], row_of(jnp.where(is_decode, offset, 0))]
    if prefill_rows is None:
        held &= is_decode
    else:
        out = jnp.where(is_decode[:, None, None], out, prefill_rows.astype(jnp.float32))
    out = jnp.where(held[:, None, None], out, jnp.nan)
    return jnp.where((token < num_actual_tokens)[:, None, None], out, 0.0)
