"""The allocator's static configuration and its state pytree.

`AllocatorConfig` is hashable and static under `jax.jit`: it fixes every shape. `AllocatorState` holds every
value the step changes, as a few device arrays: the block pool (`BlockPool`, with the prefix-cache counters) and
the requests (`RequestTable`). Fields are packed by column (`columns`); read-only properties give the familiar
views (``pool.ref_counts``, ``requests.num_table_blocks``...).

Shape letters (DESIGN.md): R requests (slots, ``max_num_seqs``) · B blocks in the pool · S block size ·
P max blocks per request of a group; here also G KV-cache groups, L ``max_model_len``, Ph hash blocks per request
(``L // hash_block_size``), C free-ring capacity, NB prefix-map buckets.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, UInt32

from .._compat import register_pytree_dataclass
from ..constants import NULL_BLOCK_ID
from ..spec import AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from .columns import (
    ADAPTER,
    CHUNKED_LOCAL,
    DROPPED,
    FREE_POS,
    FULL,
    GROUP,
    HASH_HI,
    HASHED,
    MAP_SLOT,
    NO_GROUP,
    NO_MAP_SLOT,
    NOT_FREE,
    NUM_BLOCK_FIELDS,
    NUM_COUNTERS,
    NUM_FREE,
    NUM_TOKENS,
    REF,
    RING_HEAD,
    RING_SPAN,
    ROOT_HI,
    ROOT_LO,
    ROW_GROUP_COLUMNS,
    RUNNING,
    SLIDING_WINDOW,
    STAMP,
    STAMP_COUNTER,
    STAT_HITS,
    STAT_QUERIES,
    STAT_REQUESTS,
)
from .config import KVCacheConfig
from .prefix_map import BUCKET_WIDTH, EMPTY_SLOT

__all__ = ["AllocatorConfig", "AllocatorState", "BlockPool", "PrefixCacheStats", "RequestTable", "init_state"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_int(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Static sizes and options of the allocator (hashable; a `jax.jit` static argument).

    Attributes:
      specs: one spec per KV-cache group, in group order (`KVCacheConfig.specs`).
      num_blocks: B, blocks in the pool, the null block (id 0) included.
      max_num_seqs: R, request slots.
      max_model_len: L, most tokens of one request.
      max_num_batched_tokens: most new tokens of one step (T of the step's outputs, and vLLM's admission cap).
      max_num_lookahead_tokens: most lookahead (speculative) tokens of one request in one step.
      enable_caching: prefix caching (hashing, hit search, lazy eviction).
      verify_hits: store each cached block's token ids and compare them on every prefix hit.
      sliding_window_in_window_only: chunks are clipped so that sliding-window groups allocate only blocks that a
        later step still reads (see the `step` module); off by default, as in vLLM.
    """

    specs: tuple[AttentionSpec, ...]
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_lookahead_tokens: int = 0
    enable_caching: bool = True
    verify_hits: bool = False
    sliding_window_in_window_only: bool = False

    def __post_init__(self):
        object.__setattr__(self, "specs", tuple(self.specs))
        if not self.specs:
            raise ValueError("specs=() must name at least one KV-cache group")
        for i, spec in enumerate(self.specs):
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                raise NotImplementedError(
                    f"specs[{i}] is a {type(spec).__name__}; the allocator has no manager for it"
                )
        _check_int("num_blocks", self.num_blocks, minimum=1)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("max_model_len", self.max_model_len, minimum=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        _check_int("max_num_lookahead_tokens", self.max_num_lookahead_tokens, minimum=0)
        for name in ("enable_caching", "verify_hits", "sliding_window_in_window_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.num_blocks >= 2**30:
            raise ValueError(f"num_blocks={self.num_blocks} must be < 2**30 (int32 ring indices)")
        for i, spec in enumerate(self.specs):
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != self.alignment:
                raise NotImplementedError(
                    f"specs[{i}] is chunked-local with block_size={spec.block_size}, but the groups' block sizes "
                    f"have lcm {self.alignment}: chunked-local attention needs one block size for all groups (as in vLLM)"
                )

    def __hash__(self):  # cached: jax.jit hashes its static arguments on every call
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return self.__dict__["_hash"]

    @classmethod
    def from_kv_cache_config(cls, kv_config: KVCacheConfig, **options) -> "AllocatorConfig":
        """The allocator for a `KVCacheConfig`; ``options`` are the other fields (``max_num_seqs`` ...)."""
        return cls(specs=kv_config.specs, num_blocks=kv_config.num_blocks, **options)

    # ----------------------------------------------------------------------------------------- derived sizes

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @functools.cached_property
    def kinds(self) -> tuple[int, ...]:
        kind = {
            FullAttentionSpec: FULL,
            SlidingWindowSpec: SLIDING_WINDOW,
            ChunkedLocalAttentionSpec: CHUNKED_LOCAL,
        }
        return tuple(kind[type(spec)] for spec in self.specs)

    @functools.cached_property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(spec.block_size for spec in self.specs)

    @functools.cached_property
    def sliding_windows(self) -> tuple[int, ...]:
        """Window of each sliding-window group; 0 for the others."""
        return tuple(getattr(spec, "sliding_window", 0) for spec in self.specs)

    @functools.cached_property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Chunk of each chunked-local group; 0 for the others."""
        return tuple(getattr(spec, "attention_chunk_size", 0) for spec in self.specs)

    @functools.cached_property
    def hash_block_size(self) -> int:
        """Tokens per hash block: the gcd of the groups' block sizes (vLLM's hash_block_size)."""
        return math.gcd(*self.block_sizes) if self.specs else 1

    @functools.cached_property
    def alignment(self) -> int:
        """Prefix hits and caching are aligned to the lcm of the block sizes (vLLM's hybrid coordinator)."""
        return math.lcm(*self.block_sizes) if self.specs else 1

    @functools.cached_property
    def blocks_per_row(self) -> tuple[int, ...]:
        """P of each group: block-table columns, ``cdiv(max_model_len, block_size)`` (vLLM's full-length rows)."""
        return tuple(-(-self.max_model_len // s) for s in self.block_sizes)

    @property
    def max_blocks_per_row(self) -> int:
        return max(self.blocks_per_row, default=1)

    @property
    def hash_blocks_per_row(self) -> int:
        return self.max_model_len // self.hash_block_size

    @functools.cached_property
    def attention_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups with identical specs, looked up together; full attention first (vLLM's hybrid coordinator)."""
        by_spec: dict[AttentionSpec, list[int]] = {}
        for g, spec in enumerate(self.specs):
            by_spec.setdefault(spec, []).append(g)
        ordered = sorted(by_spec.values(), key=lambda ids: self.kinds[ids[0]] != FULL)
        return tuple(tuple(ids) for ids in ordered)

    @functools.cached_property
    def admission_caps(self) -> tuple[int, ...]:
        """Most blocks one request of a group can hold at once (vLLM's ``max_admission_blocks_per_request``)."""
        caps = []
        for spec, kind, window in zip(self.specs, self.kinds, self.sliding_windows):
            cap = spec.max_num_blocks_per_request(
                max_model_len=self.max_model_len,
                max_num_batched_tokens=self.max_num_batched_tokens + self.max_num_lookahead_tokens,
            )
            if kind == SLIDING_WINDOW and self.sliding_window_in_window_only:
                # The window behind the chunk, the longest clipped chunk (`managers.in_window_chunk`), lookahead:
                # 2 * (cdiv(W - 1, S) + 1) without lookahead.
                size = spec.block_size
                longest_chunk = max(1, window - 2 + size)
                reach = window - 1 + longest_chunk + self.max_num_lookahead_tokens
                cap = min(cap, -(-reach // size) + 1)
            caps.append(cap)
        return tuple(caps)

    @functools.cached_property
    def max_step_blocks(self) -> int:
        """Most blocks one step can take from the pool: ``sum_g cdiv(T + R * lookahead, S_g) + R``."""
        tokens = self.max_num_batched_tokens + self.max_num_seqs * self.max_num_lookahead_tokens
        return max(1, sum(-(-tokens // s) + self.max_num_seqs for s in self.block_sizes))

    @property
    def max_row_blocks(self) -> int:
        """Most blocks one request can hold, free or take in one step: ``sum_g P_g``."""
        return max(1, sum(self.blocks_per_row))

    @functools.cached_property
    def max_row_step_blocks(self) -> int:
        """Most blocks one request frees, takes or caches in one step whose computed tokens advance by at most
        ``max_num_batched_tokens + max_num_lookahead_tokens``: per group ``cdiv(T + La, S) + 1``, plus the blocks
        of a whole chunk for chunked-local groups (freed together at a chunk boundary), capped at ``P``. A request
        that would exceed it (its computed tokens jumped further) fails (see `step.allocate_slots`)."""
        tokens = self.max_num_batched_tokens + self.max_num_lookahead_tokens
        per_group = (
            min(p, -(-tokens // s) + 1 + (-(-chunk // s) if chunk else 0))
            for s, p, chunk in zip(self.block_sizes, self.blocks_per_row, self.chunk_sizes, strict=True)
        )
        return max(1, sum(per_group))

    @property
    def ring_capacity(self) -> int:
        return _next_pow2(2 * self.num_blocks)

    @property
    def num_buckets(self) -> int:
        return _next_pow2(max(self.num_blocks // 2, 1))

    @property
    def stored_block_tokens(self) -> int:
        """Token ids kept per block for `verify_hits` (0 when off)."""
        return max(self.block_sizes) if self.verify_hits and self.specs else 0


def _as_uint32(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _as_int32(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


@dataclasses.dataclass(frozen=True)
class BlockPool:
    """Reference counts, the LRU free queue and the prefix map of the B blocks, packed in few arrays (each array
    is one buffer to hand over per call, and one scatter updates every field of a block).

    The free queue is a ring of block ids read from the head; an entry is live when ``free_pos[ring[i]] == i`` (a
    block taken out of the middle, by a prefix hit, leaves a stale entry that the head skips; the ring is compacted
    when stale entries fill it). Attributes:
      info: [B, 8] int32 per block: `REF` requests holding it (the null block's is never maintained), `FREE_POS`
        its ring index while free (`NOT_FREE` otherwise), `HASHED` 1 when it holds a full cached block (vLLM's
        ``block_hash is not None``), `GROUP` of that hash, `MAP_SLOT` its flat slot in the prefix map
        (`NO_MAP_SLOT` if not in it), `STAMP` insertion order (the first inserted of equal hashes is the one hit),
        `HASH_HI`/`HASH_LO` the hash (uint32 bits).
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

    # Read-only views.
    ref_counts = property(lambda self: self.info[:, REF])
    free_pos = property(lambda self: self.info[:, FREE_POS])
    block_hashed = property(lambda self: self.info[:, HASHED] != 0)
    block_group = property(lambda self: self.info[:, GROUP])
    block_slot = property(lambda self: self.info[:, MAP_SLOT])
    block_stamp = property(lambda self: self.info[:, STAMP])
    block_hash = property(lambda self: _as_uint32(self.info[:, HASH_HI:]))
    map_slots = property(lambda self: self.prefix_map[:, :-1])
    bucket_bits = property(lambda self: self.prefix_map[:, -1])
    ring_head = property(lambda self: self.counters[RING_HEAD])
    ring_span = property(lambda self: self.counters[RING_SPAN])
    num_free = property(lambda self: self.counters[NUM_FREE])
    stamp_counter = property(lambda self: self.counters[STAMP_COUNTER])
    dropped_inserts = property(lambda self: self.counters[DROPPED])


@dataclasses.dataclass(frozen=True)
class RequestTable:
    """Per request slot: its known tokens, their block hashes, and its block table in every group.

    Attributes:
      token_ids: [R, L] int32 known token ids (prompt and output so far).
      block_hashes: [R, Ph, 2] uint32 chained hash of each full hash block.
      tables: [G, R, P_max] int32 block ids; leading skipped blocks and columns past ``num_table_blocks`` hold
        `NULL_BLOCK_ID`.
      rows: [R, 5 + 3G] int32: `NUM_TOKENS` known tokens, `RUNNING` 1 once the request holds its first allocation
        (vLLM: it is in ``num_cached_block``), `ADAPTER` id, `ROOT_HI`/`ROOT_LO` parent hash of block 0 (from the
        cache salt); then per group ``num_table_blocks`` (vLLM's ``len(req_blocks)``, nulls included), ``num_null``
        (every column below holds the null block) and ``num_cached`` (vLLM's ``num_cached_block``).
    """

    token_ids: Int[Array, "R L"]
    block_hashes: UInt32[Array, "R Ph 2"]
    tables: Int[Array, "G R P_max"]
    rows: Int[Array, "R 5+3G"]

    @property
    def num_groups(self) -> int:
        return (self.rows.shape[1] - ROW_GROUP_COLUMNS) // 3

    def group_columns(self, which: int) -> Int[Array, "G R"]:
        """``which`` = 0: num_table_blocks, 1: num_null, 2: num_cached; as [G, R]."""
        start = ROW_GROUP_COLUMNS + which * self.num_groups
        return self.rows[:, start : start + self.num_groups].T

    num_tokens = property(lambda self: self.rows[:, NUM_TOKENS])
    running = property(lambda self: self.rows[:, RUNNING] != 0)
    adapter_id = property(lambda self: self.rows[:, ADAPTER])
    root = property(lambda self: _as_uint32(self.rows[:, ROOT_HI : ROOT_LO + 1]))
    num_table_blocks = property(lambda self: self.group_columns(0))
    num_null = property(lambda self: self.group_columns(1))
    num_cached = property(lambda self: self.group_columns(2))


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last read (vLLM's PrefixCacheStats): requests looked up, their tokens, hits."""

    requests: Int[Array, ""]
    queries: Int[Array, ""]
    hits: Int[Array, ""]


@dataclasses.dataclass(frozen=True)
class AllocatorState:
    pool: BlockPool
    requests: RequestTable

    @property
    def stats(self) -> PrefixCacheStats:
        counters = self.pool.counters
        return PrefixCacheStats(counters[STAT_REQUESTS], counters[STAT_QUERIES], counters[STAT_HITS])


for _cls in (BlockPool, RequestTable, AllocatorState):
    register_pytree_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def init_state(config: AllocatorConfig) -> AllocatorState:
    """A fresh allocator: every block but the null block free, in ascending id order; no request."""
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
        rows=jnp.zeros((num_rows, ROW_GROUP_COLUMNS + 3 * num_groups), jnp.int32),
    )
    return AllocatorState(pool=pool, requests=requests)
