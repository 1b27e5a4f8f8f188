"""A kernel launch's requests and tiles, planned once per step: the part of a launch that no layer changes.

`with_tokens_after_the_requests` gives the requests as the kernels see them, with one more holding the tokens after
the last request; `KernelPlan` holds them with the query tiles of the launch that writes every token's output in
[T, N, H]. The engine builds one per step and block-table width before its scans over layers
(`mixed_batch.plan_kernels`), and each layer adds its own block tables (`KernelPlan.requests`).
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._compat import register_pytree_dataclass
from ..metadata import AttentionMetadata
from ..validation import unservable_requests
from . import tiles as query_tiles

__all__ = ["KernelPlan", "direct_launch_plan", "with_tokens_after_the_requests"]


def with_tokens_after_the_requests(
    metadata: AttentionMetadata, *, num_tokens: int, block_size: int, num_blocks: int
) -> tuple[query_tiles.Requests, Int[Array, "R+1"]]:
    """The requests of `metadata` as the kernels see them (`unservable_requests` flagged, key counts and block ids
    kept inside the block table and the pool), and one more holding the tokens after the last request up to T: no
    context (no keys, so no steps), hence flagged wherever it holds a token, so that the kernel writes NaN for its
    tokens before `num_actual_tokens` (no request holds them) and 0 for the padding from there on.

    Built by gathers, not concatenations: inside a scan over layers XLA fuses them with the layers' other work on
    the metadata instead of launching a kernel per appended array and layer. Returns (the R + 1 requests, the
    request each of them copies: r, and R - 1 for the last)."""
    num_reqs = metadata.num_reqs
    request = jnp.arange(num_reqs + 1)
    before_last = request < num_reqs
    rows = jnp.minimum(request, num_reqs - 1)
    starts = metadata.query_start_loc[jnp.minimum(jnp.arange(num_reqs + 2), num_reqs)]
    query_start_loc = jnp.where(jnp.arange(num_reqs + 2) <= num_reqs, starts, num_tokens)
    seq_lens = jnp.where(before_last, metadata.seq_lens[rows], 0)
    block_tables = _tail_block_tables(metadata.block_tables, rows)
    extended = metadata.replace(query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables)
    flagged = unservable_requests(extended, block_size=block_size, num_blocks=num_blocks)
    requests = query_tiles.Requests(
        query_start_loc,
        extended.query_lens,
        jnp.minimum(seq_lens, block_tables.shape[1] * block_size),
        jnp.clip(block_tables, 0, num_blocks - 1),
        flagged,
    )
    return requests, rows


def _tail_block_tables(block_tables: Int[Array, "R P"], rows: Int[Array, "R+1"]) -> Int[Array, "R+1 P"]:
    """The block tables of `with_tokens_after_the_requests`' requests (the last, which has no keys, holds block
    0)."""
    before_last = jnp.arange(rows.shape[0]) < rows.shape[0] - 1
    return jnp.where(before_last[:, None], block_tables[rows], 0)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The part of a step's kernel launch that no layer changes: the requests as the kernels see them (with the
    tail request of `with_tokens_after_the_requests`) and the query tiles of the launch that writes every token's
    output in [T, N, H]. `plan_kernels` builds it once per step and metadata (a scan over layers would rebuild it
    in every iteration: XLA's GPU pipeline keeps loop-invariant work inside a `while` body); the layers that share
    the metadata take it as ``AttentionMetadata.kernel_plan``, with their own block tables.

    Attributes:
      query_start_loc: [R+2]; query_lens, seq_lens (within the block table), rows: [R+1]; flagged: [R+1] int32,
        as the kernel reads it (`with_tokens_after_the_requests`).
      tiles: the launch's `tiles.QueryTiles`.
      num_tokens, num_blocks, block_size, blocks_per_row, max_query_len, group_size, rows_per_tile: static, what
        the plan was built for (T, B, S, P, the metadata's bound, G, rows per tile); a call of another shape raises
        ValueError, as does one whose metadata does not vouch for its block ids (``block_ids_in_range``: the flags
        do not look at them).
    """

    query_start_loc: Int[Array, "R+2"]
    query_lens: Int[Array, "R+1"]
    seq_lens: Int[Array, "R+1"]
    flagged: Int[Array, "R+1"]
    rows: Int[Array, "R+1"]
    tiles: query_tiles.QueryTiles
    num_tokens: int
    num_blocks: int
    block_size: int
    blocks_per_row: int
    max_query_len: int
    group_size: int
    rows_per_tile: int

    def check(self, **expected: int) -> None:
        """Raise ValueError unless the plan was built for these static values (and ``num_reqs`` R)."""
        built = dict(num_tokens=self.num_tokens, num_blocks=self.num_blocks, block_size=self.block_size,
                     group_size=self.group_size, rows=self.rows_per_tile, num_reqs=self.rows.shape[0] - 1,
                     blocks_per_row=self.blocks_per_row, max_query_len=self.max_query_len,
                     block_ids_in_range=True)  # fmt: skip
        wrong = {name: (built[name], value) for name, value in expected.items() if built[name] != value}
        if wrong:
            raise ValueError(f"metadata.kernel_plan was built for another call: {wrong} (planned, called)")

    def requests(self, block_tables: Int[Array, "R P"], *, clip: bool) -> query_tiles.Requests:
        """The planned requests with a layer's block tables, gathered for the tail request; with `clip`, clipped
        into the pool (needless where the metadata vouches for its ids)."""
        tables = _tail_block_tables(block_tables, self.rows)
        if clip:
            tables = jnp.clip(tables, 0, self.num_blocks - 1)
        return query_tiles.Requests(self.query_start_loc, self.query_lens, self.seq_lens, tables, self.flagged)


register_pytree_dataclass(
    KernelPlan,
    data_fields=["query_start_loc", "query_lens", "seq_lens", "flagged", "rows", "tiles"],
    meta_fields=["num_tokens", "num_blocks", "block_size", "blocks_per_row", "max_query_len", "group_size",
                 "rows_per_tile"],
)


def direct_launch_plan(metadata: AttentionMetadata, tiled: Bool[Array, "R"], *, num_tokens: int, block_size: int,
                        num_blocks: int, group_size: int, rows: int) -> KernelPlan:  # fmt: skip
    """The `KernelPlan` of the launch whose tiles hold the requests of `tiled` (and the tail request)."""
    requests, request_rows = with_tokens_after_the_requests(
        metadata, num_tokens=num_tokens, block_size=block_size, num_blocks=num_blocks
    )
    tiled = jnp.where(jnp.arange(metadata.num_reqs + 1) < metadata.num_reqs, tiled[request_rows], True)
    tiles = query_tiles.prefill_tiles(requests.query_lens, group_size, num_tokens, rows=rows, tiled=tiled)
    # the flags as the kernel reads them (int32), converted here rather than in every layer's launch
    return KernelPlan(requests.query_start_loc, requests.query_lens, requests.seq_lens,
                      requests.flagged.astype(jnp.int32), request_rows, tiles, num_tokens=num_tokens, num_blocks=num_blocks, block_size=block_size,
                      blocks_per_row=metadata.block_tables.shape[1], max_query_len=metadata.max_query_len,
                      group_size=group_size, rows_per_tile=rows)  # fmt: skip
