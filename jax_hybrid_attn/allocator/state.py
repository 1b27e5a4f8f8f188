"""The allocator's state pytree: every value the step changes, as a few device arrays.

`AllocatorState` holds the block pool (`BlockPool`, with the prefix-cache counters) and the request slots
(`RequestTable`). Fields are packed by column (`columns`); `BlockPool.blocks` and `RequestTable.fields` read them
by name, and a few read-only properties give the familiar views (``pool.ref_counts``,
``requests.num_table_blocks``...).

Shape letters: R request slots (``max_num_seqs``), B blocks in the pool, S block size, P max blocks per request
of a group (P_max over the groups); here also G KV-cache groups, L ``max_model_len``, Ph hash blocks per request
(``L // hash_block_size``), C free-ring capacity, NB prefix-map buckets, W slots per bucket.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Int, UInt32

from .._compat import register_pytree_dataclass
from ..constants import NULL_BLOCK_ID
from .columns import (
    DROPPED,
    FREE_POS,
    GROUP,
    MAP_SLOT,
    NO_GROUP,
    NO_MAP_SLOT,
    NOT_FREE,
    NUM_BLOCK_FIELDS,
    NUM_COUNTERS,
    NUM_FREE,
    NUM_GROUP_COUNTERS,
    RING_HEAD,
    RING_SPAN,
    ROW_GROUP_COLUMNS,
    STAMP_COUNTER,
    STAT_HITS,
    STAT_QUERIES,
    STAT_REQUESTS,
    BlockRows,
    RequestRows,
)
from .config import AllocatorConfig, check_config
from .prefix_map import BUCKET_WIDTH, EMPTY_SLOT

__all__ = ["AllocatorState", "BlockPool", "PrefixCacheStats", "RequestTable", "init_state"]


@dataclasses.dataclass(frozen=True)
class BlockPool:
    """Reference counts, the LRU free queue and the prefix map of the B blocks, packed in few arrays (each array
    is one buffer to hand over per call, and one scatter updates every field of a block).

    The free queue is a ring of block ids read from the head; an entry is live when ``free_pos[ring[i]] == i`` (a
    block taken out of the middle, by a prefix hit, leaves a stale entry that the head skips; the ring is compacted
    when stale entries fill it). Attributes:
      info: [B, 8] int32 per block (fields named by `BlockRows`): `REF` requests holding it (the null block's is
        never maintained), `FREE_POS` its ring index while free (`NOT_FREE` otherwise), `HASHED` 1 when it holds a
        full cached block (vLLM's ``block_hash is not None``), `GROUP` of that hash, `MAP_SLOT` its flat slot in the
        prefix map (`NO_MAP_SLOT` if not in it), `STAMP` insertion order (the first inserted of equal hashes is the
        one hit), `HASH_HI`/`HASH_LO` the hash (uint32 bits).
      ring: [C] int32 block ids.
      prefix_map: [NB, W + 1] int32: W slots of block ids (`EMPTY_SLOT` when empty) of the two-choice bucketed
        prefix map, then a bit mask of the used slots.
      block_tokens: [B, S_max] int32 token ids of cached blocks (S_max = 0 unless ``verify_hits``).
      counters: [8] int32: `RING_HEAD`, `RING_SPAN` (entries from the head, stale ones included), `NUM_FREE` (live
        entries), `STAMP_COUNTER`, `DROPPED` (inserts that found both buckets full), and the prefix-cache statistics
        `STAT_REQUESTS`, `STAT_QUERIES`, `STAT_HITS` since the last read.
    """

    info: Int[Array, "B 8"]
    ring: Int[Array, "C"]
    prefix_map: Int[Array, "NB W+1"]
    block_tokens: Int[Array, "B S_max"]
    counters: Int[Array, "8"]

    blocks = property(lambda self: BlockRows(self.info))
    """Every block's fields by name (``pool.blocks.ref`` ...)."""
    ref_counts = property(lambda self: self.blocks.ref)
    free_pos = property(lambda self: self.blocks.free_pos)
    block_hashed = property(lambda self: self.blocks.hashed)
    ring_head = property(lambda self: self.counters[RING_HEAD])
    ring_span = property(lambda self: self.counters[RING_SPAN])
    num_free = property(lambda self: self.counters[NUM_FREE])
    stamp_counter = property(lambda self: self.counters[STAMP_COUNTER])
    dropped_inserts = property(lambda self: self.counters[DROPPED])

    @property
    def stats(self) -> "PrefixCacheStats":
        """The prefix-cache counters since the last read."""
        counters = self.counters
        return PrefixCacheStats(counters[STAT_REQUESTS], counters[STAT_QUERIES], counters[STAT_HITS])


@dataclasses.dataclass(frozen=True)
class RequestTable:
    """Per request slot: its known tokens, their block hashes, and its block table in every group.

    Attributes:
      token_ids: [R, L] int32 known token ids (prompt and output so far).
      block_hashes: [R, Ph, 2] uint32 chained hash of each full hash block.
      tables: [G, R, P_max] int32 block ids; leading skipped blocks and columns past ``num_table_blocks`` hold
        `NULL_BLOCK_ID`.
      rows: [R, 5 + 3G] int32 (fields named by `RequestRows`): `NUM_TOKENS` known tokens, `RUNNING` 1 once the
        request holds its first allocation (vLLM: it is in ``num_cached_block``), `ADAPTER` id, `ROOT_HI`/`ROOT_LO`
        parent hash of block 0 (from the cache salt); then per group ``num_table_blocks`` (vLLM's
        ``len(req_blocks)``, nulls included), ``num_null`` (every column below holds the null block) and
        ``num_cached`` (vLLM's ``num_cached_block``).
    """

    token_ids: Int[Array, "R L"]
    block_hashes: UInt32[Array, "R Ph 2"]
    tables: Int[Array, "G R P_max"]
    rows: Int[Array, "R 5+3G"]

    fields = property(lambda self: RequestRows(self.rows))
    """Every slot's fields by name (``requests.fields.num_tokens`` ...)."""
    num_tokens = property(lambda self: self.fields.num_tokens)
    running = property(lambda self: self.fields.running)
    num_table_blocks = property(lambda self: self.fields.num_table_blocks)
    num_null = property(lambda self: self.fields.num_null)
    num_cached = property(lambda self: self.fields.num_cached)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last read (vLLM's ``PrefixCacheStats``): requests looked up, their tokens,
    tokens hit. Scalar arrays from `AllocatorState.stats`; ints from `KVCacheManager.make_prefix_cache_stats`."""

    requests: int | Int[Array, ""]
    queries: int | Int[Array, ""]
    hits: int | Int[Array, ""]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass(frozen=True)
class AllocatorState:
    pool: BlockPool
    requests: RequestTable

    @property
    def stats(self) -> PrefixCacheStats:
        """The prefix-cache counters since the last read (`BlockPool.stats`)."""
        return self.pool.stats


for _cls in (BlockPool, RequestTable, AllocatorState):
    register_pytree_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def init_state(config: AllocatorConfig) -> AllocatorState:
    """A fresh allocator: every block but the null block free, in ascending id order; no request."""
    check_config(config)
    num_blocks, capacity = config.num_blocks, config.ring_capacity
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    info = jnp.zeros((num_blocks, NUM_BLOCK_FIELDS), jnp.int32)
    info = info.at[:, FREE_POS].set(jnp.where(ids == NULL_BLOCK_ID, NOT_FREE, ids - 1))
    info = info.at[:, GROUP].set(NO_GROUP).at[:, MAP_SLOT].set(NO_MAP_SLOT)
    counters = (
        jnp.zeros(NUM_COUNTERS, jnp.int32).at[RING_SPAN].set(num_blocks - 1).at[NUM_FREE].set(num_blocks - 1)
    )
    prefix_map = jnp.full((config.num_buckets, BUCKET_WIDTH + 1), EMPTY_SLOT, jnp.int32).at[:, -1].set(0)
    pool = BlockPool(
        info=info,
        ring=jnp.full(capacity, NULL_BLOCK_ID, jnp.int32).at[: num_blocks - 1].set(ids[1:]),
        prefix_map=prefix_map,
        block_tokens=jnp.zeros((num_blocks, config.stored_block_tokens), jnp.int32),
        counters=counters,
    )
    num_rows, num_groups = config.max_num_seqs, config.num_groups
    requests = RequestTable(
        token_ids=jnp.zeros((num_rows, config.max_model_len), jnp.int32),
        block_hashes=jnp.zeros((num_rows, config.hash_blocks_per_row, 2), jnp.uint32),
        tables=jnp.full((num_groups, num_rows, config.max_blocks_per_row), NULL_BLOCK_ID, jnp.int32),
        rows=jnp.zeros((num_rows, ROW_GROUP_COLUMNS + NUM_GROUP_COUNTERS * num_groups), jnp.int32),
    )
    return AllocatorState(pool=pool, requests=requests)
