"""The rules of each attention type (vLLM's single-type KV-cache managers) as array formulas: skipped tokens and
blocks, hit search, caching mask, in-window chunks.

One row of per-group constants (`GroupConstants`, each [G, 1]) broadcasts over requests, so every formula runs
for all groups and requests at once; the kinds are static, so XLA keeps only the branches that exist.

Skipped tokens (``n`` tokens computed, the next one at position ``n``):
  * full attention: 0;
  * sliding window W: ``max(0, n - W + 1)`` (W=4, n=7: tokens 0..3);
  * chunked-local C: ``(n // C) * C`` (C=8: n=13 -> 8, n=8 -> 8, n=7 -> 0).
A block is skipped only when all its tokens are (block 2, window 4, n=4: one token, no block).

Hit search over one request (``hit[i]``: block i of the request is cached in the group; `max_length` tokens):
  * full: left to right, stop at the first miss;
  * sliding window: right to left for ``cdiv(W - 1, S)`` contiguous hits whose rightmost block ends on an
    alignment boundary; else the aligned run touching block 0, however short;
  * chunked-local: blocks before the current chunk count without lookup; then left to right from the chunk start.
Every result is a multiple of the alignment (the lcm of the groups' block sizes).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..integers import cdiv
from .config import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, AllocatorConfig

__all__ = [
    "FINDERS",
    "GroupConstants",
    "by_spec",
    "cacheable_mask",
    "find_chunked_local",
    "find_full",
    "find_sliding_window",
    "group_constants",
    "hit_start_block",
    "in_window_chunk",
    "kind_mask",
    "num_skipped_tokens",
    "per_block",
    "skipped_blocks",
]


@dataclasses.dataclass(frozen=True)
class GroupConstants:
    """Per-group static values as [G, 1] int32 arrays (they broadcast over [G, R])."""

    kind: Int[Array, "G 1"]
    block_size: Int[Array, "G 1"]
    window: Int[Array, "G 1"]
    chunk: Int[Array, "G 1"]
    cap: Int[Array, "G 1"]
    hash_scale: Int[Array, "G 1"]
    blocks_per_row: Int[Array, "G 1"]

    def of(self, group: Int[Array, "E"]) -> "GroupConstants":
        """The constants of each event's group, as [E] arrays."""
        return GroupConstants(**{f.name: getattr(self, f.name)[group, 0] for f in dataclasses.fields(self)})


def group_constants(config: AllocatorConfig) -> GroupConstants:
    def column(values):
        return jnp.asarray(values, jnp.int32)[:, None]

    return GroupConstants(
        kind=column(config.kinds),
        block_size=column(config.block_sizes),
        window=column(config.sliding_windows),
        chunk=column([max(c, 1) for c in config.chunk_sizes]),
        cap=column(config.admission_caps),
        hash_scale=column([s // config.hash_block_size for s in config.block_sizes]),
        blocks_per_row=column(config.blocks_per_row),
    )


def num_skipped_tokens(c: GroupConstants, num_computed: Int[Array, "... R"]) -> Int[Array, "G R"]:
    """Tokens no later query of the request can attend to, per group."""
    sliding = jnp.maximum(0, num_computed - c.window + 1)
    chunked = (num_computed // c.chunk) * c.chunk
    return jnp.where(c.kind == SLIDING_WINDOW, sliding, jnp.where(c.kind == CHUNKED_LOCAL, chunked, 0))


def in_window_chunk(config, num_computed: Int[Array, "R"], num_new: Int[Array, "R"]) -> Int[Array, "R"]:
    """`num_new` clipped, under ``sliding_window_in_window_only``, so that every new token's K/V is still read by
    a later step in every sliding-window group: the chunk then needs no block that is out of the window when it
    ends (nothing is allocated, then freed), and every token has a cache slot for this step's attention.

    A chunk from position n may hold ``W - 2 + S - n % S`` tokens (at least ``W - 1``), and always 1.
    """
    if not config.sliding_window_in_window_only:
        return num_new
    for kind, block_size, window in zip(config.kinds, config.block_sizes, config.sliding_windows):
        if kind == SLIDING_WINDOW:
            limit = jnp.maximum(1, window - 2 + block_size - num_computed % block_size)
            num_new = jnp.minimum(num_new, limit)
    return num_new


def _first_false(ok: Bool[Array, "P"]) -> Int[Array, ""]:
    """Index of the first False (len(ok) if none)."""
    return jnp.where(jnp.all(ok), ok.shape[0], jnp.argmin(ok)).astype(jnp.int32)


def find_full(hit: Bool[Array, "P"], max_length, *, block_size: int, alignment: int) -> Int[Array, ""]:
    """Hit tokens of a full-attention group: cached blocks from the start, aligned down."""
    index = jnp.arange(hit.shape[0])
    num_blocks = jnp.minimum(
        _first_false(hit | (index >= max_length // block_size)), max_length // block_size
    )
    return (num_blocks * block_size // alignment) * alignment


def find_sliding_window(
    hit: Bool[Array, "P"], max_length, *, block_size: int, alignment: int, window: int
) -> Int[Array, ""]:
    """Hit tokens of a sliding-window group (vLLM's right-to-left scan, as one vector expression)."""
    index = jnp.arange(hit.shape[0], dtype=jnp.int32)
    hit = hit & (index < max_length // block_size)
    need = cdiv(window - 1, block_size)
    aligned = ((index + 1) * block_size) % alignment == 0
    last_miss = jax.lax.cummax(jnp.where(hit, -1, index))
    run = index - last_miss  # hits from the start of this run of hits up to i
    candidate = hit & aligned & (run >= need)
    found = jnp.max(jnp.where(candidate, index + 1, 0))
    first_miss = _first_false(hit)
    prefix = jnp.max(jnp.where(aligned & (index < first_miss), index + 1, 0))
    return jnp.where(found > 0, found, prefix) * block_size


def find_chunked_local(hit: Bool[Array, "P"], max_length, *, block_size: int, chunk: int) -> Int[Array, ""]:
    """Hit tokens of a chunked-local group: completed chunks free, then hits from the current chunk's start."""
    index = jnp.arange(hit.shape[0], dtype=jnp.int32)
    start = (max_length // chunk) * chunk // block_size
    end = max_length // block_size
    return jnp.minimum(_first_false(hit | (index < start) | (index >= end)), end) * block_size


def hit_start_block(c: GroupConstants, hit_length: Int[Array, "..."]) -> Int[Array, "G ..."]:
    """First real block of each group's hit list of `hit_length` tokens; blocks before it are null blocks."""
    num_blocks = hit_length // c.block_size
    need = jnp.maximum(cdiv(c.window - 1, c.block_size), 1)
    sliding = jnp.maximum(num_blocks - need, 0)
    chunked = (hit_length // c.chunk) * c.chunk // c.block_size
    return jnp.where(c.kind == SLIDING_WINDOW, sliding, jnp.where(c.kind == CHUNKED_LOCAL, chunked, 0))


def cacheable_mask(c: GroupConstants, position: Int[Array, "..."], alignment: int) -> Bool[Array, "..."]:
    """vLLM's sliding-window ``_cache_block_mask``: with an alignment of several blocks, a window group
    caches only the last ``cdiv(W - 1, S)`` blocks of each alignment segment (no hit can start elsewhere)."""
    per_segment = alignment // c.block_size
    tail = cdiv(c.window - 1, c.block_size)
    masked = (c.kind == SLIDING_WINDOW) & (tail < per_segment)
    return ~masked | (position % per_segment >= per_segment - tail)


FINDERS = {FULL: find_full, SLIDING_WINDOW: find_sliding_window, CHUNKED_LOCAL: find_chunked_local}


# Per-group formulas with the group's numbers as Python ints: XLA turns a division by a constant into shifts or
# multiplications, where a division by a value read from an array stays a slow integer division.


def by_spec(config: AllocatorConfig, fn) -> Array:
    """``stack([fn(g) for g in groups])``, computing `fn` once per distinct spec (`fn` takes no per-group data)."""
    done: dict = {}
    for g, spec in enumerate(config.specs):
        if spec not in done:
            done[spec] = fn(g)
    return jnp.stack([done[spec] for spec in config.specs])


def per_block(config: AllocatorConfig, tokens, *, round_up: bool = False):
    """``tokens // S_g`` (``cdiv`` with `round_up`) for every group: [G, ...] for `tokens` [...]."""
    return jnp.stack([cdiv(tokens, size) if round_up else tokens // size for size in config.block_sizes])


def skipped_blocks(config: AllocatorConfig, num_computed: Int[Array, "R"]) -> Int[Array, "G R"]:
    """Blocks wholly skipped by each group after `num_computed` tokens (`num_skipped_tokens` // S)."""

    def one(g):
        kind, size = config.kinds[g], config.block_sizes[g]
        if kind == SLIDING_WINDOW:
            return jnp.maximum(0, num_computed - config.sliding_windows[g] + 1) // size
        if kind == CHUNKED_LOCAL:
            chunk = config.chunk_sizes[g]
            return num_computed // chunk * (chunk // size)
        return jnp.zeros_like(num_computed)

    return by_spec(config, one)


def kind_mask(config: AllocatorConfig, kind: int) -> Bool[Array, "G 1"]:
    return jnp.asarray([k == kind for k in config.kinds])[:, None]
