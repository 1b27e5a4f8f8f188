"""The jitted allocator step: `allocate_slots` for a batch of requests, `free`, prefix hits, reset, usage.

`allocate_slots` is vLLM's ``KVCacheManager.allocate_slots`` (and, for a request that holds no blocks yet, the
``get_computed_blocks`` the scheduler calls just before it) for every row of a batch, in row order, in one
jitted call with no host round trip. Row r sees the state left by rows < r, as vLLM's scheduler loop does; a row
that cannot be served changes nothing (no reference count, free queue or table change) and later rows proceed.

For one row (``n`` tokens computed, ``t`` new tokens, ``la`` lookahead, all in tokens):
  1. A row whose slot holds no blocks (a new or preempted request) with ``n == 0`` looks up its prefix in the
     cache (hits capped at ``num_tokens - 1``); its computed tokens become ``n + hits`` and ``t`` is clipped to the
     tokens left (``min(t, num_tokens - n - hits)``).
  2. Per group, blocks wholly before the window or chunk of token ``n`` are replaced by the null block and
     freed, highest index first.
  3. Blocks needed: ``cdiv(min(n + t + la, max_model_len), S) - len(blocks)``, plus prefix-hit blocks that sit in
     the free queue (touching them takes them out of it). With ``full_sequence_must_fit``, the row also needs
     room for all its known tokens with the window/chunk admission cap applied (vLLM's admission gate).
  4. If the free queue has room (counting the blocks step 2 frees), hits are touched, new blocks are taken from
     the head of the free queue, group by group, and full blocks up to ``min(n + t, num_tokens)`` (rounded down to
     the lcm of the block sizes when there are several groups) are offered to the prefix cache.

Speed (the XLA CPU runtime pays a few microseconds per operation, so the step is a few hundred array
operations whatever R is):
  * Rows with nothing to do this step (a decode that neither crosses a block edge nor frees nor caches a block,
    i.e. 14 of 16 decodes with block 16) succeed without any work.
  * The others go in order, up to `CHUNK_ROWS` at a time, through a vectorised path with one event slot per
    (row, group): running requests that free only hashed blocks (to the tail of the free queue) and need at most
    one new block and one cached block per group. Taking every row's blocks from the head in row order is then
    exactly what the sequential loop does; the free room each row sees is a prefix sum over the rows before it.
  * The first row this path cannot serve exactly (a new request, a row that frees an unhashed block or needs
    several blocks, a row that fails) goes alone through the general one-row path; then the vectorised path
    resumes after it.
  * Rarely needed work sits in 0-or-1-trip loops, which update the state in place (`lax.cond` would copy the
    state arrays on the CPU). On a GPU each such check is a host sync of its predicate, so an iteration has two:
    ring compaction with stamp re-ranking before the frees and takes (one check for both, in either path), then
    prefix-map inserts that collided together with the one-row path. Cheap exact checks run unconditionally on a
    GPU (`columns.cpu_cond`).
  * On a CPU, `compiled.compile_allocate_slots` compiles the step so that XLA runs each of its gathers and scatters
    over the large state arrays as one task (jax.jit's compile splits them over 2 threads, which costs more than
    it saves at these sizes).

Deliberate differences from vLLM:
  * A row whose step would free, take or cache more than `AllocatorConfig.max_row_step_blocks` blocks fails: that
    happens only when its ``num_computed_tokens`` jumps further than ``max_num_batched_tokens`` (plus lookahead)
    past what it held, which no scheduler step does. The bound keeps the one-row path's arrays small.
  * A failed row leaves the state unchanged; vLLM frees its out-of-window blocks (step 2) before it fails. The
    success test is the same (those blocks count as free room).
  * Hits are searched inside the step, so the scheduler passes a token budget for a new request instead of an
    exact count after hits; ``num_scheduled_tokens`` reports what was scheduled.
  * ``sliding_window_in_window_only`` (off by default; not in vLLM): each row's chunk is clipped so that a later
    step still reads every new token's K/V in every sliding-window group (at most ``W - 2 + S - n % S`` tokens
    from position n, at least ``W - 1``; `managers.in_window_chunk`). No block is then allocated and freed again
    one step later, every token has a cache slot (the kernels read this step's keys from the cache), and the peak
    per request drops from ``cdiv(W - 1 + T, S) + 1`` to ``2 * (cdiv(W - 1, S) + 1)`` (plus lookahead). For a
    running request ``num_new_tokens`` is then a budget too; ``num_scheduled_tokens`` says what was scheduled.
  * No external (connector) tokens, EAGLE, delayed caching, encoder tokens, KV events.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._compat import register_pytree_dataclass
from ..constants import NULL_BLOCK_ID, PAD_SLOT_ID
from . import pool as pool_ops
from .columns import (
    ADAPTER,
    FULL,
    HASHED,
    NUM_FREE,
    NUM_TOKENS,
    REF,
    ROW_GROUP_COLUMNS,
    RUNNING,
    STAT_HITS,
    STAT_QUERIES,
    STAT_REQUESTS,
    cpu_cond,
    cumsum,
    run_if,
    updated,
)
from .coordinator import compute_hits, may_hit
from .prefix_map import Inserts
from .managers import cacheable_mask, group_constants, in_window_chunk, kind_mask, per_block, skipped_blocks
from .state import AllocatorConfig, AllocatorState

__all__ = ["StepOutput", "allocate_slots", "free", "get_computed_blocks", "reset_prefix_cache", "usage"]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one `allocate_slots` call scheduled, as device arrays ready for the kernels (R = batch rows).

    Attributes:
      success: [R] bool, the row got its blocks (False for padding rows and rows that did not fit).
      num_computed_tokens: [R] tokens already in the cache, prefix hits included.
      num_new_computed_tokens: [R] of which prefix hits found by this call.
      num_scheduled_tokens: [R] tokens to compute this step (0 unless `success`).
      query_start_loc: [R + 1] cumulative `num_scheduled_tokens`.
      seq_lens: [R] ``num_computed_tokens + num_scheduled_tokens``.
      positions: [T] position of each scheduled token (0 for padding); T = ``max_num_batched_tokens``.
      token_ids: [T] its token id, where known (0 otherwise).
      block_tables: [G, R, P_max] int32 block ids; group g's table is ``block_tables[g, :, :P_g]``
        (`NULL_BLOCK_ID` outside the window or chunk and past the end). None with ``return_block_tables=False``.
      slot_mappings: [G, T] int32 ``block_id * S + offset`` of each token in each group, `PAD_SLOT_ID` for padding.
    """

    success: Bool[Array, "R"]
    num_computed_tokens: Int[Array, "R"]
    num_new_computed_tokens: Int[Array, "R"]
    num_scheduled_tokens: Int[Array, "R"]
    query_start_loc: Int[Array, "R+1"]
    seq_lens: Int[Array, "R"]
    positions: Int[Array, "T"]
    token_ids: Int[Array, "T"]
    block_tables: Int[Array, "G R P_max"] | None
    slot_mappings: Int[Array, "G T"]


register_pytree_dataclass(
    StepOutput, data_fields=[f.name for f in dataclasses.fields(StepOutput)], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class _Rows:
    slot: Int[Array, "R"]
    num_computed: Int[Array, "R"]
    num_new: Int[Array, "R"]
    num_lookahead: Int[Array, "R"]
    must_fit: Bool[Array, "R"]
    active: Bool[Array, "R"]

    def at(self, r) -> "_Rows":
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1), self)

    def pack(self) -> Int[Array, "R 6"]:
        return jnp.stack([getattr(self, f.name).astype(jnp.int32) for f in dataclasses.fields(self)], axis=1)

    @classmethod
    def unpack(cls, packed: Int[Array, "R 6"]) -> "_Rows":
        columns = {f.name: packed[:, i] for i, f in enumerate(dataclasses.fields(cls))}
        return cls(**{**columns, "must_fit": columns["must_fit"] != 0, "active": columns["active"] != 0})


register_pytree_dataclass(_Rows, data_fields=[f.name for f in dataclasses.fields(_Rows)], meta_fields=[])


def _materialize(x):
    """Compute `x` once: without this, XLA fuses a gather into each of its consumers and repeats it."""
    return jax.lax.optimization_barrier(x)


def _table_index(config: AllocatorConfig, group, slot, column):
    """Flat index into ``tables.reshape(-1)`` of ``tables[group, slot, column]``."""
    return (group * config.max_num_seqs + slot) * config.max_blocks_per_row + column


def _group_counters(row: Int[Array, "R 5+3G"], num_groups: int):
    """(num_table_blocks, num_null, num_cached) of gathered request rows, each [G, R]."""
    start = ROW_GROUP_COLUMNS
    return tuple(row[:, start + k * num_groups : start + (k + 1) * num_groups].T for k in range(3))


def _expand(counts: Int[Array, "N"], capacity: int, ends: Int[Array, "N"] | None = None):
    """Enumerate ``counts[i]`` events for each i, in order, into `capacity` slots (`ends`: ``cumsum(counts)``, if the
    caller has it).

    Returns (segment i of each event, its index inside the segment, whether the slot holds an event).
    """
    ends = cumsum(counts) if ends is None else ends
    starts = ends - counts
    marks = jnp.zeros(capacity, jnp.int32).at[starts].add(1, mode="drop")
    segment = jnp.clip(cumsum(marks) - 1, 0, counts.shape[0] - 1)
    event = jnp.arange(capacity, dtype=jnp.int32)
    return segment, event - starts[segment], event < ends[-1]


def _per_row(values: Int[Array, "E"], rows: Int[Array, "E"], num_rows: int) -> Int[Array, "R"]:
    return jnp.zeros(num_rows, jnp.int32).at[rows].add(values.astype(jnp.int32))


def _process(
    config: AllocatorConfig, state: AllocatorState, rows: _Rows, *, single: bool, maintain: bool = True
):
    """Allocate for `rows`.

    ``single``: one row, any kind. Otherwise: the leading run of rows that the vectorised path serves exactly
    (running requests that free only hashed blocks, need at most one block per group, and fit); each (row, group)
    is then one event slot. Returns (state, (success, computed, scheduled, hits)[, where the run stops, prefix-map
    inserts left pending]). With ``maintain=False`` (vectorised path only) no rare work is done: when the ring needs
    compaction or the stamps re-ranking, no row is served.
    """
    c = group_constants(config)
    req, pool = state.requests, state.pool
    num_rows, num_groups, width = rows.slot.shape[0], config.num_groups, config.max_blocks_per_row
    length = config.max_model_len

    slot_ok = (rows.slot >= 0) & (rows.slot < config.max_num_seqs)
    slot = jnp.clip(rows.slot, 0, config.max_num_seqs - 1)
    row = _materialize(req.rows[slot])  # [R, 5 + 3G]
    running = row[:, RUNNING] != 0
    is_new = ~running
    num_tokens = row[:, NUM_TOKENS]

    # 1. Prefix hits of a request that holds no blocks yet.
    hit_tokens = jnp.zeros(num_rows, jnp.int32)
    hit_first = jnp.zeros((num_groups, num_rows), jnp.int32)
    hit_lists = None
    if single and config.enable_caching:
        search = rows.active[0] & slot_ok[0] & is_new[0] & (rows.num_computed[0] == 0) & (rows.num_new[0] > 0)
        # A prompt whose first block misses in a full-attention group has no hit: skip the search.
        lookup = search & may_hit(config, pool, req, slot[0], num_tokens[0] - 1)

        def do_search(_):
            return compute_hits(config, pool, req, slot[0], num_tokens[0] - 1)

        def no_search(_):
            nulls = jnp.full((num_groups, width), NULL_BLOCK_ID, jnp.int32)
            return jnp.zeros((), jnp.int32), nulls, jnp.zeros(num_groups, jnp.int32)

        found, lists, first_real = jax.lax.cond(lookup, do_search, no_search, None)
        hit_tokens, hit_first, hit_lists = found[None], first_real[:, None], lists[:, None, :]
        counters = pool.counters
        counters = updated(
            counters,
            {
                STAT_REQUESTS: counters[STAT_REQUESTS] + search.astype(jnp.int32),
                STAT_QUERIES: counters[STAT_QUERIES] + jnp.where(search, num_tokens[0], 0),
                STAT_HITS: counters[STAT_HITS] + jnp.where(search, found, 0),
            },
        )
        pool = dataclasses.replace(pool, counters=counters)

    computed = rows.num_computed + hit_tokens
    new_tokens = jnp.where(is_new, jnp.minimum(rows.num_new, num_tokens - computed), rows.num_new)
    new_tokens = in_window_chunk(config, computed, new_tokens)
    valid = (
        rows.active
        & slot_ok
        & (rows.num_new > 0)
        & (new_tokens > 0)
        & (rows.num_computed >= 0)
        & (rows.num_lookahead >= 0)
        & (computed + new_tokens <= length)
    )
    end = jnp.minimum(computed + new_tokens + rows.num_lookahead, length)

    # 2-3. Per group [G, R]: skipped blocks to free, the block list after hits, blocks to take.
    skipped = skipped_blocks(config, computed)
    num_blocks, num_null, num_cached = _group_counters(row, num_groups)
    hit_blocks = per_block(config, hit_tokens)
    freeable = jnp.minimum(skipped, num_blocks)
    free_count = jnp.where((running & valid)[None, :], jnp.maximum(freeable - num_null, 0), 0)
    base_len = jnp.where(is_new[None, :], jnp.maximum(skipped, hit_blocks), num_blocks)
    null_after = jnp.where(is_new[None, :], jnp.maximum(skipped, hit_first), jnp.maximum(num_null, freeable))
    required = per_block(config, end, round_up=True)
    new_count = jnp.where(valid[None, :], jnp.maximum(required - base_len, 0), 0)
    len_after = jnp.maximum(base_len, required)

    evictable = jnp.zeros(num_rows, jnp.int32)
    if hit_lists is not None:
        column = jnp.arange(width, dtype=jnp.int32)
        touch_from = jnp.maximum(skipped, hit_first)
        touch_mask = (
            (column >= touch_from[..., None])
            & (column < hit_blocks[..., None])
            & (hit_lists != NULL_BLOCK_ID)
            & valid[None, :, None]
        )
        evictable = jnp.sum(touch_mask & (pool.info[hit_lists, REF] == 0), axis=(0, 2), dtype=jnp.int32)
    need = jnp.sum(new_count, axis=0) + evictable

    known_blocks = per_block(config, jnp.minimum(num_tokens, length), round_up=True)
    capped = jnp.where(kind_mask(config, FULL), known_blocks, jnp.minimum(known_blocks, c.cap))
    gate_held = jnp.where(is_new[None, :], jnp.maximum(skipped, hit_blocks), num_blocks)
    gate = jnp.sum(jnp.maximum(capped - gate_held, 0), axis=0) + evictable

    cache_from = jnp.where(is_new[None, :], base_len, num_cached)
    if config.enable_caching:
        cache_until = jnp.minimum(computed + new_tokens, num_tokens)
        if num_groups > 1:
            cache_until = cache_until // config.alignment * config.alignment
        cache_until = per_block(config, cache_until)
        cache_count = jnp.where(valid[None, :], jnp.maximum(cache_until - cache_from, 0), 0)
        cached_after = jnp.maximum(cache_from, cache_until)
    else:
        cache_count = jnp.zeros_like(cache_from)
        cached_after = cache_from

    # Events in order: row, group, then (frees) block index from high to low. Each (row, group) is one vLLM
    # free_blocks call. Single row: enumerated from the counts; batch: one event slot per (row, group).
    def events(counts, capacity):
        """(row, group, index inside the (row, group), present) of each event slot."""
        if single:
            call, index, present = _expand(counts.T.reshape(-1), capacity)
            return call // num_groups, call % num_groups, index, present
        call = jnp.arange(num_rows * num_groups, dtype=jnp.int32)
        return call // num_groups, call % num_groups, jnp.zeros_like(call), counts.T.reshape(-1) > 0

    capacity = config.max_row_step_blocks if single else num_rows * num_groups
    ev_row, ev_group, index, present = events(free_count, capacity)
    ev_pos = freeable[ev_group, ev_row] - 1 - index
    flat_tables = req.tables.reshape(-1)  # flat indices: one cheap 1-D gather or scatter each
    ev_index = _table_index(config, ev_group, slot[ev_row], jnp.clip(ev_pos, 0, width - 1))
    ev_block = flat_tables[ev_index]
    ev_real = present & (ev_block != NULL_BLOCK_ID)
    ev_info = pool.info[ev_block]
    ref_before = ev_info[:, REF]
    num_free = pool.counters[NUM_FREE]

    if single:
        free_room = num_free + jnp.sum(ev_real & (ref_before == 1), dtype=jnp.int32)
        fits = (  # every event has a slot (`AllocatorConfig.max_row_step_blocks`)
            (jnp.sum(free_count) <= capacity)
            & (jnp.sum(new_count) <= capacity)
            & (jnp.sum(cache_count) <= capacity)
        )
        commit = valid & fits & (need <= free_room) & (~rows.must_fit | (gate <= num_free))
    else:

        def exact_zero():  # a block shared by several rows reaches 0 at its last event, if every holder frees it
            count, last = pool_ops.repeated_events(ev_block, ev_real, pool.info.shape[0])
            return last & (ref_before == count)

        reaches_zero = cpu_cond(
            jnp.any(ev_real & (ref_before > 1)), exact_zero, lambda: ev_real & (ref_before == 1)
        )
        freed = jnp.sum(reaches_zero.reshape(num_rows, num_groups), axis=1, dtype=jnp.int32)
        unhashed = jnp.any((ev_real & (ev_info[:, HASHED] == 0)).reshape(num_rows, num_groups), axis=1)
        delta = jnp.where(valid, freed - need, 0)
        free_before = num_free + cumsum(delta) - delta
        ok = valid & (need <= free_before + freed) & (~rows.must_fit | (gate <= free_before))
        one_each = jnp.all((free_count <= 1) & (new_count <= 1) & (cache_count <= 1), axis=0)
        stop = valid & ~(ok & running & ~unhashed & one_each)
        first_stop = jnp.where(jnp.any(stop), jnp.argmax(stop), num_rows).astype(jnp.int32)
        commit = valid & (jnp.arange(num_rows) < first_stop)

    # 4. Commit: free skipped blocks, touch hits, take new blocks, cache full blocks.
    take_count = jnp.where(commit[None, :], new_count, 0)
    if hit_lists is not None:
        # Touch before the compaction check: free hit blocks leave the queue, and the stale entries they leave
        # (anywhere in the ring, the take window included) must be seen by the check. A row that touches is a new
        # request, which frees nothing, so touches and frees never meet in one row.
        touch_now = touch_mask & commit[None, :, None]
        pool = pool_ops.touch(pool, hit_lists.reshape(-1), touch_now.reshape(-1))
    if single:
        reaches_zero = ev_real & (ref_before == 1)  # a row's events name distinct blocks
    appended = jnp.sum(reaches_zero & commit[ev_row], dtype=jnp.int32)
    # One rare-work check (one host sync on a GPU): ring compaction for the frees and the takes, stamp re-ranking.
    compaction = pool_ops.needs_compaction(
        pool, appended=appended, count=jnp.sum(take_count), max_count=capacity
    )
    due = compaction | pool_ops.stamps_near_overflow(pool)
    if maintain:

        def do_maintain(pool):
            pool = run_if(compaction, lambda pool: (pool_ops.compact(pool),), pool)[0]
            return (pool_ops.renormalize_stamps(pool),)

        pool = run_if(due, do_maintain, pool)[0]
    else:  # commit nothing: the caller's loop does the rare work, then these rows
        commit = commit & ~due
        first_stop = jnp.where(due, 0, first_stop)
        take_count = jnp.where(commit[None, :], new_count, 0)
    commit_ev = ev_real & commit[ev_row]
    tables = flat_tables.at[jnp.where(commit_ev, ev_index, flat_tables.shape[0])].set(
        NULL_BLOCK_ID, mode="drop"
    )
    pool = pool_ops.free_blocks(
        pool,
        ev_block,
        commit_ev,
        ev_row * num_groups + ev_group,
        num_calls=num_rows * num_groups,
        unique=single,
        hashed_only=not single,
        compact=False,
    )
    if hit_lists is not None:
        group_index = jnp.broadcast_to(jnp.arange(num_groups)[:, None, None], hit_lists.shape)
        hit_index = _table_index(config, group_index, slot[None, :, None], column)
        tables = tables.at[jnp.where(touch_now, hit_index, tables.shape[0])].set(hit_lists, mode="drop")

    pool, taken = pool_ops.take(pool, jnp.sum(take_count), capacity)
    tk_row, tk_group, index, present = events(take_count, capacity)
    rank = jnp.arange(capacity) if single else cumsum(present) - 1
    tk_pos = base_len[tk_group, tk_row] + index
    tk_index = _table_index(config, tk_group, slot[tk_row], jnp.clip(tk_pos, 0, width - 1))
    tables = tables.at[jnp.where(present, tk_index, tables.shape[0])].set(taken[rank], mode="drop")

    inserts = Inserts.none(capacity)
    if config.enable_caching:  # the batch path leaves colliding prefix-map inserts for the caller's rare path
        cc_row, cc_group, index, present = events(jnp.where(commit[None, :], cache_count, 0), capacity)
        position = cache_from[cc_group, cc_row] + index
        cached = _cache(config, pool, req, tables, slot[cc_row], cc_group, position, present, finish=single)
        pool, inserts = (cached, inserts) if single else cached

    new_row = jnp.concatenate(
        [
            row[:, :RUNNING],
            jnp.ones_like(row[:, RUNNING:ADAPTER]),
            row[:, ADAPTER:ROW_GROUP_COLUMNS],
            len_after.T,
            null_after.T,
            cached_after.T,
        ],
        axis=1,
    )
    rows_table = req.rows.at[jnp.where(commit, slot, config.max_num_seqs)].set(new_row, mode="drop")
    tables = tables.reshape(req.tables.shape)
    state = AllocatorState(pool=pool, requests=dataclasses.replace(req, tables=tables, rows=rows_table))
    result = (commit, computed, jnp.where(commit, new_tokens, 0), hit_tokens)
    if single:
        return state, result
    return state, result, first_stop, inserts


def _cache(config, pool, req, tables, slot, group, position, present, *, finish: bool):
    """Offer block `position` of each event's (request slot, group) to the prefix cache (`pool.cache_blocks`)."""
    block = tables[_table_index(config, group, slot, jnp.clip(position, 0, config.max_blocks_per_row - 1))]
    sizes = set(config.block_sizes)
    if len(sizes) == 1:  # one block size: Python constants, no per-event lookups or divisions
        (block_size,) = sizes
        scale, mask = block_size // config.hash_block_size, present
    else:
        c = group_constants(config).of(group)
        block_size, scale = c.block_size, c.hash_scale
        mask = present & cacheable_mask(c, position, config.alignment)
    key_index = jnp.clip((position + 1) * scale - 1, 0, config.hash_blocks_per_row - 1)
    flat_hashes = req.block_hashes.reshape(
        -1, 2
    )  # a 1-D row gather is much cheaper than a 2-D one on the CPU
    keys = flat_hashes[slot * config.hash_blocks_per_row + key_index]
    tokens = None
    if config.verify_hits:
        offset = jnp.arange(config.stored_block_tokens, dtype=jnp.int32)
        size = jnp.reshape(block_size, (-1, 1))
        token_pos = jnp.clip(position[:, None] * size + offset, 0, config.max_model_len - 1)
        tokens = jnp.where(offset < size, req.token_ids[slot[:, None], token_pos], 0)
    return pool_ops.cache_blocks(pool, block, keys, group, mask, tokens, finish=finish)


def _outputs(
    config, state, rows: _Rows, success, computed, scheduled, hits, *, num_tokens, block_tables
) -> StepOutput:
    req = state.requests
    slot_ok = (rows.slot >= 0) & (rows.slot < config.max_num_seqs)
    slot = jnp.clip(rows.slot, 0, config.max_num_seqs - 1)
    ends = cumsum(scheduled)
    row, index, token_ok = _expand(scheduled, num_tokens, ends)
    position = jnp.where(token_ok, computed[row] + index, 0)
    token_slot = slot[row]
    known = position < req.rows[token_slot, NUM_TOKENS]
    token_ids = jnp.where(token_ok & known, req.token_ids[token_slot, position], 0)
    groups = jnp.arange(config.num_groups, dtype=jnp.int32)[:, None]
    column = per_block(config, position)  # [G, T]
    index = _table_index(config, groups, token_slot[None, :], column)
    block = req.tables.reshape(-1)[index]  # [G, T]: one gather for every group
    block_size = jnp.asarray(config.block_sizes, jnp.int32)[:, None]
    offset = position[None, :] - column * block_size
    mapping = jnp.where(token_ok & (block != NULL_BLOCK_ID), block * block_size + offset, PAD_SLOT_ID)
    tables = None
    if block_tables:  # one gather for all groups (a tuple of per-group tables would cost a copy each)
        # Padding rows read past the end: null blocks.
        rows_or_out = jnp.where(slot_ok, slot, config.max_num_seqs)
        tables = req.tables.at[:, rows_or_out].get(mode="fill", fill_value=NULL_BLOCK_ID)
    return StepOutput(
        success=success,
        num_computed_tokens=computed,
        num_new_computed_tokens=hits,
        num_scheduled_tokens=scheduled,
        query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32), ends]),
        seq_lens=computed + scheduled,
        positions=position,
        token_ids=token_ids,
        block_tables=tables,
        slot_mappings=mapping,
    )


def _as_rows(
    slots, num_computed_tokens, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit
) -> _Rows:
    slots = jnp.asarray(slots, jnp.int32)
    zeros = jnp.zeros(slots.shape, jnp.int32)

    def column(x, default, dtype):
        return default if x is None else jnp.broadcast_to(jnp.asarray(x, dtype), slots.shape)

    return _Rows(
        slot=slots,
        num_computed=column(num_computed_tokens, zeros, jnp.int32),
        num_new=column(num_new_tokens, zeros, jnp.int32),
        num_lookahead=column(num_lookahead_tokens, zeros, jnp.int32),
        must_fit=column(full_sequence_must_fit, jnp.zeros(slots.shape, bool), bool),
        active=jnp.ones(slots.shape, bool),
    )


CHUNK_ROWS = 64
"""Rows the vectorised path serves per iteration (rows with nothing to do are skipped before)."""


def _idle_rows(config: AllocatorConfig, state: AllocatorState, rows: _Rows):
    """Rows to skip: (idle, bad). Idle: a running request whose step frees, takes and caches nothing (it
    succeeds and changes nothing); bad: padding, a slot named twice, or a running request's invalid numbers."""
    req = state.requests
    num_rows = rows.slot.shape[0]
    slot_ok = (rows.slot >= 0) & (rows.slot < config.max_num_seqs)
    slot = jnp.clip(rows.slot, 0, config.max_num_seqs - 1)
    first_row = (
        jnp.full(config.max_num_seqs, num_rows, jnp.int32)
        .at[slot]
        .min(jnp.where(slot_ok, jnp.arange(num_rows, dtype=jnp.int32), num_rows))
    )
    slot_ok = slot_ok & (first_row[slot] == jnp.arange(num_rows))
    row = _materialize(req.rows[slot])
    running = row[:, RUNNING] != 0
    computed, new_tokens = rows.num_computed, in_window_chunk(config, rows.num_computed, rows.num_new)
    valid = (
        slot_ok
        & (new_tokens > 0)
        & (computed >= 0)
        & (rows.num_lookahead >= 0)
        & (computed + new_tokens <= config.max_model_len)
    )
    num_blocks, num_null, num_cached = _group_counters(row, config.num_groups)
    skipped = skipped_blocks(config, computed)
    end = jnp.minimum(computed + new_tokens + rows.num_lookahead, config.max_model_len)
    # Each test materialized on its own: one fusion reading every column would be split over 2 tasks (XLA's CPU
    # cost model counts its bytes 10 times as compute once the fusion has more operations than bytes).
    busy = _materialize(
        jnp.any(
            (jnp.minimum(skipped, num_blocks) > num_null)
            | (per_block(config, end, round_up=True) > num_blocks),
            axis=0,
        )
    )
    if config.enable_caching:
        cache_until = jnp.minimum(computed + new_tokens, row[:, NUM_TOKENS])
        if config.num_groups > 1:
            cache_until = cache_until // config.alignment * config.alignment
        busy = busy | _materialize(jnp.any(per_block(config, cache_until) > num_cached, axis=0))
    idle = running & valid & ~rows.must_fit & ~busy
    return idle, ~slot_ok | (running & ~valid)


def _check_reusable(previous: StepOutput, out: StepOutput) -> None:
    """`allocate_slots`' ``previous_output`` must have this call's output shapes (so that its buffers can hold it)."""
    for field in dataclasses.fields(StepOutput):
        old, new = getattr(previous, field.name), getattr(out, field.name)
        old_shape = None if old is None else (tuple(old.shape), jnp.dtype(old.dtype).name)
        new_shape = None if new is None else (tuple(new.shape), jnp.dtype(new.dtype).name)
        if old_shape != new_shape:
            raise ValueError(
                f"previous_output.{field.name} is {old_shape}, but this step's is {new_shape}: pass the output of a "
                "call with the same rows, num_tokens and return_block_tables"
            )


@partial(
    jax.jit,
    static_argnames=("config", "num_tokens", "return_block_tables"),
    donate_argnames=("state", "previous_output"),
    keep_unused=True,  # `previous_output` is not read, only donated
)
def allocate_slots(
    config: AllocatorConfig,
    state: AllocatorState,
    slots: Int[Array, "R"],
    num_computed_tokens: Int[Array, "R"],
    num_new_tokens: Int[Array, "R"],
    num_lookahead_tokens: Int[Array, "R"] | None = None,
    full_sequence_must_fit: Bool[Array, "R"] | None = None,
    *,
    num_tokens: int | None = None,
    return_block_tables: bool = True,
    previous_output: StepOutput | None = None,
) -> tuple[AllocatorState, StepOutput]:
    """Allocate blocks for one scheduler step of a batch of requests, in row order (see the module docstring).

    `state` is donated. Rows with a negative slot are padding.

    Args:
      slots: [R] request slot of each row (`manager.KVCacheManager` maps request ids to slots).
      num_computed_tokens: [R] tokens of the request already in the cache (0 for a new request; prefix hits are
        found here and added).
      num_new_tokens: [R] tokens to compute this step; for a request that holds no blocks, a budget (clipped to
        the tokens left after prefix hits). Their sum must be <= `num_tokens`.
      num_lookahead_tokens: [R] extra slots to reserve (speculative tokens); default 0.
      full_sequence_must_fit: [R] bool, also require room for all known tokens (vLLM's admission gate).
      num_tokens: T, static length of the per-token outputs (default ``max_num_batched_tokens``; bucket it,
        e.g. T = R for decode-only steps).
      return_block_tables: gather each row's block tables into `StepOutput.block_tables` ([G, R, P_max]). With
        False it is None: when rows are the slots in order, ``state.requests.tables`` is the same table (a
        persistent block table, as vLLM's model runner keeps), with no copy.
      previous_output: the `StepOutput` of an earlier call with the same shapes, donated: this call writes its
        output into those buffers instead of new ones. On a GPU this keeps the step's CUDA graphs at the same
        addresses from call to call, so XLA re-records only the few nodes that read the per-step inputs (about
        half the GPU step's time otherwise). Its values are not read.

    Returns:
      (new state, `StepOutput`).
    """
    rows = _as_rows(slots, num_computed_tokens, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit)
    num_rows = rows.slot.shape[0]
    chunk = min(num_rows, CHUNK_ROWS)
    idle, bad = _idle_rows(config, state, rows)
    success = idle
    computed = jnp.where(bad, 0, rows.num_computed)
    scheduled = jnp.where(idle, in_window_chunk(config, rows.num_computed, rows.num_new), 0)
    hits = jnp.zeros(num_rows, jnp.int32)
    work = ~idle & ~bad
    packed = rows.pack()

    def rows_at(members):
        present = members < num_rows
        gathered = _Rows.unpack(packed[jnp.minimum(members, num_rows - 1)])  # one gather for every field
        return dataclasses.replace(gathered, active=present)

    def work_queue(work):
        """The rows with work, in order, then `num_rows` (padding): [num_rows + chunk]."""
        position = jnp.where(work, cumsum(work) - 1, num_rows + chunk)
        return (
            jnp.full(num_rows + chunk, num_rows, jnp.int32)
            .at[position]
            .set(jnp.arange(num_rows, dtype=jnp.int32))
        )

    def record(members, ok, sched, success, scheduled):
        where_ok = jnp.where(ok, members, num_rows)
        return success.at[where_ok].set(True, mode="drop"), scheduled.at[where_ok].set(sched, mode="drop")

    # The first chunk of rows with work, outside any loop and without rare work: in the common step this serves
    # every row, and the loop below does not run (on a GPU its condition is then the step's only host sync).
    members = work_queue(work)[:chunk]
    state, (ok, _, sched, _), _, inserts = _process(
        config, state, rows_at(members), single=False, maintain=False
    )
    success, scheduled = record(members, ok, sched, success, scheduled)
    work = work & ~success  # rows left for the loop, which rebuilds their queue when it runs (rarely)

    def one_row(row, state, success, computed, scheduled, hits):  # the general path, for one row
        state, (ok, comp, sched, hit) = _process(config, state, rows.at(row), single=True)

        def put(arr, value):
            return arr.at[row].set(value[0].astype(arr.dtype))

        return state, put(success, ok), put(computed, comp), put(scheduled, sched), put(hits, hit)

    def vectorised(queue, k, state, *results):  # a chunk from `k`, then the row it stopped at
        success, computed, scheduled, hits = results
        members = jax.lax.dynamic_slice_in_dim(queue, k, chunk)
        state, (ok, _, sched, _), stop, inserts = _process(config, state, rows_at(members), single=False)
        success, scheduled = record(members, ok, sched, success, scheduled)
        stop_row = jnp.where(stop < chunk, members[jnp.minimum(stop, chunk - 1)], num_rows)

        def rare(state, *results):  # one host sync on a GPU for both kinds of rare work
            state = dataclasses.replace(state, pool=pool_ops.finish_inserts(state.pool, inserts))
            return run_if(stop_row < num_rows, partial(one_row, stop_row), state, *results)

        state, *results = run_if(
            (stop_row < num_rows) | jnp.any(inserts.pending), rare, state, success, computed, scheduled, hits
        )
        return (jnp.where(stop < chunk, k + stop + 1, k + chunk), state, *results)

    # A row that holds no blocks goes straight to the general path.
    def new_request(queue, k, state, *results):
        return (k + 1, *one_row(queue[k], state, *results))

    def step(carry):
        k, state, inserts, *results = carry
        pool = run_if(  # the inserts left by the first chunk
            jnp.any(inserts.pending), lambda pool: (pool_ops.finish_inserts(pool, inserts),), state.pool
        )[0]
        state = dataclasses.replace(state, pool=pool)
        queue = work_queue(work)
        head = queue[k]  # the next row with work (`num_rows` once only inserts are left)
        slot_of_head = jnp.clip(rows.slot[jnp.minimum(head, num_rows - 1)], 0, config.max_num_seqs - 1)
        head_is_new = (head < num_rows) & (state.requests.rows[slot_of_head, RUNNING] == 0)
        carry = run_if(~head_is_new, partial(vectorised, queue), k, state, *results)
        k, state, *results = run_if(head_is_new, partial(new_request, queue), *carry)
        return (k, state, Inserts.none(inserts.pending.shape[0]), *results)

    count = jnp.sum(work, dtype=jnp.int32)
    carry = (jnp.zeros((), jnp.int32), state, inserts, success, computed, scheduled, hits)
    _, state, _, success, computed, scheduled, hits = jax.lax.while_loop(
        lambda c: (c[0] < count) | jnp.any(c[2].pending), step, carry
    )
    out = _outputs(
        config,
        state,
        rows,
        success,
        computed,
        scheduled,
        hits,
        num_tokens=config.max_num_batched_tokens if num_tokens is None else num_tokens,
        block_tables=return_block_tables,
    )
    if previous_output is not None:
        _check_reusable(previous_output, out)
    return state, out


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def free(config: AllocatorConfig, state: AllocatorState, slots: Int[Array, "R"]) -> AllocatorState:
    """Free every block of each request (finished or preempted), in row order; each group frees its blocks
    tail first. The slots keep their tokens and hashes (a preempted request is resumed as a new request)."""
    slots = jnp.asarray(slots, jnp.int32)
    num_groups, width = config.num_groups, config.max_blocks_per_row

    def one(i, state):
        req = state.requests
        slot_ok = (slots[i] >= 0) & (slots[i] < config.max_num_seqs)
        slot = jnp.clip(slots[i], 0, config.max_num_seqs - 1)
        reverse = req.tables[:, slot, ::-1]  # [G, P]: tail block first
        position = width - 1 - jnp.arange(width, dtype=jnp.int32)
        lengths = req.rows[slot, ROW_GROUP_COLUMNS : ROW_GROUP_COLUMNS + num_groups]
        mask = slot_ok & (position[None, :] < lengths[:, None]) & (reverse != NULL_BLOCK_ID)
        calls = jnp.broadcast_to(jnp.arange(num_groups, dtype=jnp.int32)[:, None], reverse.shape)
        pool = pool_ops.free_blocks(
            state.pool,
            reverse.reshape(-1),
            mask.reshape(-1),
            calls.reshape(-1),
            num_calls=num_groups,
            unique=True,
        )
        drop = jnp.where(slot_ok, slot, config.max_num_seqs)
        cleared = req.rows[slot].at[RUNNING].set(0).at[ROW_GROUP_COLUMNS:].set(0)
        req = dataclasses.replace(
            req,
            tables=req.tables.at[:, drop, :].set(NULL_BLOCK_ID, mode="drop"),
            rows=req.rows.at[drop].set(cleared, mode="drop"),
        )
        return dataclasses.replace(state, pool=pool, requests=req)

    return jax.lax.fori_loop(0, slots.shape[0], one, state)


@partial(jax.jit, static_argnames=("config",))
def get_computed_blocks(config: AllocatorConfig, state: AllocatorState, slots: Int[Array, "R"]):
    """Prefix hits of requests as they stand (read only; `allocate_slots` searches again when it runs).

    Returns (hit tokens [R], per group [R, P_g] hit block lists with null blocks). Hits are capped at
    ``num_tokens - 1`` so that the last token is computed; 0 when caching is off.
    """
    slots = jnp.clip(jnp.asarray(slots, jnp.int32), 0, config.max_num_seqs - 1)
    if not config.enable_caching:
        nulls = jnp.full((slots.shape[0], config.max_blocks_per_row), NULL_BLOCK_ID, jnp.int32)
        return jnp.zeros(slots.shape, jnp.int32), tuple(nulls[:, :p] for p in config.blocks_per_row)

    def one(slot):
        length, lists, _ = compute_hits(
            config, state.pool, state.requests, slot, state.requests.rows[slot, NUM_TOKENS] - 1
        )
        return length, lists

    lengths, lists = jax.vmap(one)(slots)
    return lengths, tuple(lists[:, g, :p] for g, p in enumerate(config.blocks_per_row))


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def reset_prefix_cache(config: AllocatorConfig, state: AllocatorState):
    """Forget every cached hash, only when no block is in use. Returns (state, whether it was reset)."""
    del config
    pool, ok = pool_ops.reset_prefix_cache(state.pool)
    return dataclasses.replace(state, pool=pool), ok


def usage(state: AllocatorState) -> Array:
    """Fraction of usable blocks in use: ``1 - num_free / (num_blocks - 1)``."""
    usable = state.pool.info.shape[0] - 1
    return 1.0 - state.pool.counters[NUM_FREE] / max(usable, 1)
