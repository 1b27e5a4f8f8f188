"""The hybrid block allocator: vLLM v1's hybrid KV-cache manager with its state as a pytree and its step jitted.

Behaviour: vLLM's `KVCacheManager` with the hybrid coordinator (one block pool shared by every KV-cache group; a
prefix hit must hold in every group), free order of vLLM 0.33 (unhashed blocks to the head of the free queue, hashed
ones to the tail). Use `KVCacheManager` from Python, or the jitted functions (`add_requests`, `append_token_ids`,
`allocate_slots`, `free`, `get_computed_blocks`, `reset_prefix_cache`) on an `AllocatorState` directly.

Modules, one job each:
  config            KV-cache groups, tensors and num_blocks from per-layer specs; `AllocatorConfig` (static)
  columns           the packed layout of the state arrays, its sentinels, and named views to read it
  state             the `AllocatorState` pytree (block pool, request slots) and `init_state`
  hashing           chained 64-bit block hashes in JAX
  prefix_map        hash -> block map in arrays
  pool              free queue, reference counts, caching and lazy eviction
  group_rules       per attention type (vLLM's single-type managers): skipped blocks, hit search, caching mask
  coordinator       prefix hits over all groups (hybrid fixed point)
  requests          request slots: token ids and block hashes
  row_plan          the step's per-row arithmetic: what each group of each row frees, takes and caches
  commit            a step's events into the pool, its new block tables and request rows
  single_row        the step's general path: one row of any kind
  vectorised        the step's fast path: a run of rows served at once
  step              `allocate_slots` (the rows in order), `free`, `get_computed_blocks`, `reset_prefix_cache`
  common_prefix     the leading blocks every running request holds, per group (for cascade attention)
  xla_cpu           workarounds for XLA's CPU runtime, with their measured gains; the pinned compile
  request_batches   requests added and freed a batch per device call; the checks of the requests given
  kv_cache_manager  `KVCacheManager`, a thin Python object around the jitted functions; `compile_allocate_slots`

Deliberate differences from vLLM (each explained where it is made):
  * A request that cannot be served leaves the state unchanged; vLLM first frees its out-of-window blocks.
  * Prefix hits are searched inside `allocate_slots` for a request that holds no blocks, so a batch sees the
    blocks cached by its earlier rows, as vLLM's scheduler loop does; the scheduler gives such a request a token
    budget, and the step reports how many tokens it scheduled.
  * Block hashes: a fixed-seed 64-bit non-cryptographic hash (stable across processes) instead of sha256 with a
    random seed; a coarse block is keyed by its last fine hash instead of the concatenation; optional token
    verification on every hit.
  * The prefix map is a bucketed table: if both buckets of a key are full (negligible, counted) the block is not
    findable, though it keeps its hash.
  * The startup check and `max_concurrency` keep the null block out of the usable blocks.
  * Beyond vLLM: `sliding_window_in_window_only` (chunks clipped so that no block is allocated, then freed); one
    jitted call for a whole batch, on CPU or GPU, writing into the previous call's output buffers when given
    them (`previous_output`: on a GPU the step's CUDA graph then keeps its addresses).
  * Not supported: Mamba, cross-attention, MLA, sinks-full specs, EAGLE, external (connector) tokens, delayed
    caching, KV-cache events, data/context parallelism, multimodal and prompt-embedding extra keys, mixed page
    sizes of one attention type through `UniformTypeKVCacheSpecs`.
"""

from .common_prefix import num_common_prefix_blocks, step_common_prefix_blocks
from .config import (
    AllocatorConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    blocks_per_request,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    get_kv_cache_groups,
    max_concurrency,
    unify_page_sizes,
)
from .hashing import NO_ADAPTER, cache_salt_words
from .kv_cache_manager import KVCacheManager, compile_allocate_slots
from .pool import free_queue_order
from .requests import add_requests, append_token_ids
from .state import AllocatorState, PrefixCacheStats, init_state
from .step import StepOutput, allocate_slots, free, get_computed_blocks, reset_prefix_cache, usage
from .xla_cpu import compile_single_task

PrefixCacheStatsSnapshot = PrefixCacheStats
"""The name `KVCacheManager.make_prefix_cache_stats`' result had (`state.PrefixCacheStats`)."""

__all__ = [
    "NO_ADAPTER",
    "AllocatorConfig",
    "AllocatorState",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheTensor",
    "PrefixCacheStatsSnapshot",
    "StepOutput",
    "add_requests",
    "allocate_slots",
    "append_token_ids",
    "blocks_per_request",
    "cache_salt_words",
    "check_enough_kv_cache_memory",
    "compile_allocate_slots",
    "compile_single_task",
    "estimate_max_model_len",
    "free",
    "free_queue_order",
    "get_computed_blocks",
    "get_kv_cache_config",
    "get_kv_cache_groups",
    "init_state",
    "max_concurrency",
    "num_common_prefix_blocks",
    "step_common_prefix_blocks",
    "reset_prefix_cache",
    "unify_page_sizes",
    "usage",
]
