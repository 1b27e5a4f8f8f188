"""Query tiles: which tokens of which request each CTA row block holds, and the packing around the kernel.

A tile holds up to ``64 // G`` consecutive query tokens of one request; its row ``j * G + g`` is token j,
query head ``h * G + g`` of KV head h. Requests whose whole query fits one tile are decode tiles (one per
request, keys split across CTAs); longer queries are cut into prefill tiles. Both tables have static
sizes (a bound from R and T), so building them needs no host round trip; unused tiles have length 0.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._compat import register_pytree_dataclass
from .paged_attention import ROWS

__all__ = ["ROWS", "QueryTiles", "decode_tiles", "prefill_tiles", "tile_rows", "pack_query_rows", "merge_splits", "scatter_rows"]


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    request: Int[Array, "NT"]  # request of each tile
    query_start: Int[Array, "NT"]  # offset of the tile's first token within its request's query
    query_len: Int[Array, "NT"]  # tokens in the tile; 0 for an idle tile


register_pytree_dataclass(QueryTiles, data_fields=["request", "query_start", "query_len"], meta_fields=[])


def tokens_per_tile(group_size: int) -> int:
    """Query tokens one tile holds: the 64 rows fit ``64 // G`` tokens of G heads."""
    return ROWS // group_size


def decode_tiles(query_lens: Int[Array, "R"], group_size: int) -> QueryTiles:
    """One tile per request whose query fits a tile; longer requests get an idle tile."""
    fits = query_lens <= tokens_per_tile(group_size)
    num_reqs = query_lens.shape[0]
    return QueryTiles(
        request=jnp.arange(num_reqs, dtype=jnp.int32),
        query_start=jnp.zeros(num_reqs, jnp.int32),
        query_len=jnp.where(fits, query_lens, 0).astype(jnp.int32),
    )


def prefill_tiles(query_lens: Int[Array, "R"], group_size: int, num_tokens: int) -> QueryTiles:
    """Tiles of ``64 // G`` tokens over the requests whose query does not fit one tile.

    The table has ``R + T // tokens_per_tile`` entries, enough for any lengths summing to T."""
    per_tile = tokens_per_tile(group_size)
    num_reqs = query_lens.shape[0]
    tiles_per_request = jnp.where(query_lens > per_tile, -(-query_lens // per_tile), 0)
    ends = jnp.cumsum(tiles_per_request)
    index = jnp.arange(num_reqs + num_tokens // per_tile, dtype=jnp.int32)
    request = jnp.minimum(jnp.searchsorted(ends, index, side="right"), num_reqs - 1).astype(jnp.int32)
    local = index - (ends[request] - tiles_per_request[request])
    query_start = local * per_tile
    query_len = jnp.where(index < ends[-1], jnp.clip(query_lens[request] - query_start, 0, per_tile), 0)
    return QueryTiles(request=request, query_start=query_start.astype(jnp.int32), query_len=query_len.astype(jnp.int32))


def tile_rows(tiles: QueryTiles, query_start_loc, *, group_size: int, num_kv_heads: int, num_tokens: int):
    """Token [NT, 64] and query head [K, 64] of each row; rows past a tile's tokens get token T."""
    row = jnp.arange(ROWS)
    offset = row // group_size
    tokens = jnp.where(
        offset < tiles.query_len[:, None],
        query_start_loc[tiles.request][:, None] + tiles.query_start[:, None] + offset,
        num_tokens,
    )
    heads = jnp.arange(num_kv_heads)[:, None] * group_size + row % group_size
    return tokens, heads


def pack_query_rows(q: Float[Array, "T N H"], tokens, heads) -> Float[Array, "NT K 64 H"]:
    return q.at[tokens[:, None, :], heads[None, :, :]].get(mode="fill", fill_value=0)


def merge_splits(partial_out, lse, sinks_rows):
    """Combine splits: [NT, K, splits, 64, H] with lse [NT, K, splits, 64] -> [NT, K, 64, H] float32.

    `sinks_rows` [K, 64] (or None) adds one unscaled logit per row to the softmax denominator only."""
    lse_max = lse.max(axis=2)
    if sinks_rows is not None:
        lse_max = jnp.maximum(lse_max, sinks_rows)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lse - lse_max[:, :, None])  # [NT, K, splits, 64]
    denominator = weights.sum(axis=2)
    if sinks_rows is not None:
        denominator = denominator + jnp.exp(sinks_rows - lse_max)
    out = jnp.einsum("tksi,tksih->tkih", weights, partial_out)
    return out / jnp.where(denominator > 0, denominator, 1.0)[..., None]


def scatter_rows(out: Float[Array, "T N H"], rows: Float[Array, "NT K 64 H"], tokens, heads) -> jax.Array:
    """Write each row back to its token and head; rows of token T (padding) are dropped."""
    return out.at[tokens[:, None, :], heads[None, :, :]].set(rows.astype(out.dtype), mode="drop")
