"""The step's vectorised path: a run of rows served at once, exactly as the one-row path would serve them in turn.

It serves the leading rows of a chunk that are running requests which free only hashed blocks and need at most one
new block and one cached block per group, and fit. Each (row, group) is then one event slot. Hashed blocks go to
the tail of the free queue, so taking every row's new blocks from the head in row order is what the sequential
loop does; the free room each row sees is a prefix sum over the rows before it (plus the blocks its own frees
return). The first row that does not qualify stops the run; the caller serves it with the one-row path
(`single_row`), then resumes here after it.

With ``multi_block`` (the step's loop, where prefill rows go) a row may also free (hashed blocks: they all go to
the tail), take and cache several blocks per group, and a new request that surely has no prefix hit is served here
too: it would look up nothing, or nothing that can hit (a full-attention group misses its first block, and no
earlier row of the run shares that block's hash, so none of them caches it first). Frees, takes and caches are
then enumerated into `multi_block_capacity` event slots each, in vLLM's order (row, group, block; frees from the
highest index down); a row whose events would not fit stops the run.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..integers import cdiv
from . import commit as commit_ops
from . import pool as pool_ops
from .columns import STAT_QUERIES, STAT_REQUESTS
from .config import AllocatorConfig
from .coordinator import may_hit
from .prefix_map import Inserts
from .row_plan import RowPlan, RowResults, StepRows, gather_rows, looks_up_prefix, plan_rows
from .state import AllocatorState, BlockPool, RequestTable
from .xla_cpu import cpu_cond, cumsum, updated

__all__ = ["allocate_leading_rows", "multi_block_capacity"]


def multi_block_capacity(config: AllocatorConfig, num_rows: int) -> int:
    """Take (and cache) event slots of a ``multi_block`` run of `num_rows` rows: a step's tokens fill
    ``cdiv(T, S)`` blocks per group, and each row may start one more (a run that needs more stops early)."""
    per_group = (cdiv(config.max_num_batched_tokens, size) + num_rows for size in config.block_sizes)
    return min(sum(per_group), config.num_blocks)  # a run takes or caches distinct blocks


def _reaching_zero(pool: BlockPool, frees: commit_ops.Frees) -> Bool[Array, "E"]:
    """Whether each free event's block reaches reference count 0: a block held by several of the rows does so at
    its last event, if every holder frees it."""
    real, ref_before = frees.real, frees.info.ref

    def exact():
        count, last = pool_ops.repeated_events(frees.block, real, pool.info.shape[0])
        return last & (ref_before == count)

    return cpu_cond(jnp.any(real & (ref_before > 1)), exact, lambda: real & (ref_before == 1))


def _without_hits(
    config: AllocatorConfig, pool: BlockPool, requests: RequestTable, rows: StepRows, plan: RowPlan
) -> Bool[Array, "R"]:
    """Whether each new request would surely find no prefix hit when its turn comes in the run (see the module
    docstring). Running requests look up nothing: True."""
    stored = plan.stored
    searches = looks_up_prefix(rows, plan.is_new)
    if not config.enable_caching:
        return jnp.ones_like(searches)
    max_length = stored.num_tokens - 1
    may = jax.vmap(lambda slot, length: may_hit(config, pool, requests, slot, length))(plan.slot, max_length)
    first_key = requests.block_hashes[plan.slot, 0]  # [R, 2]: chained into every block hash of the request
    has_key = stored.num_tokens >= config.hash_block_size
    same = jnp.all(first_key[:, None, :] == first_key[None, :, :], axis=-1) & has_key[None, :]
    earlier = jnp.tril(jnp.ones(same.shape, bool), k=-1)  # [r, i]: row i comes before row r
    shared = jnp.any(same & earlier & rows.active[None, :], axis=1)
    possible = max_length >= config.alignment
    return ~searches | ~(may | (shared & possible))


def _first_stop(
    config: AllocatorConfig,
    plan: RowPlan,
    rows: StepRows,
    frees: commit_ops.Frees,
    reaches_zero: Bool[Array, "E"],
    num_free: Int[Array, ""],
    without_hits: Bool[Array, "R"] | None,
) -> Int[Array, ""]:
    """Index of the first valid row that this path cannot serve exactly (R if none): it does not fit in the free
    room left by the rows before it or frees an unhashed block; without `without_hits` (the one-block path), frees,
    takes or caches more than one block in a group or is a new request; with it, is a new request that may hit,
    or its frees, takes or caches overflow `multi_block_capacity` or `AllocatorConfig.max_row_step_blocks`."""
    num_groups, num_rows = plan.free_count.shape
    row = frees.events.row
    freed = jnp.zeros(num_rows, jnp.int32).at[row].add(reaches_zero.astype(jnp.int32))
    unhashed = jnp.zeros(num_rows, bool).at[row].max(frees.real & ~frees.info.hashed)
    need = plan.new_blocks
    delta = jnp.where(plan.valid, freed - need, 0)
    free_before = num_free + cumsum(delta) - delta  # free blocks when the row's turn comes
    fits = plan.valid & (need <= free_before + freed) & (~rows.must_fit | (plan.gate_blocks <= free_before))
    if without_hits is None:
        one_each = jnp.all((plan.free_count <= 1) & (plan.new_count <= 1) & (plan.cache_count <= 1), axis=0)
        servable = plan.stored.running & one_each
    else:
        capacity = multi_block_capacity(config, num_rows)
        counts = [jnp.sum(count, axis=0) for count in (plan.free_count, plan.new_count, plan.cache_count)]
        row_fits = functools.reduce(jnp.logical_and, [count <= config.max_row_step_blocks for count in counts])
        in_slots = functools.reduce(
            jnp.logical_and, [cumsum(jnp.where(plan.valid, count, 0)) <= capacity for count in counts]
        )
        servable = without_hits & row_fits & in_slots
    stop = plan.valid & ~(fits & servable & ~unhashed)
    if without_hits is not None:  # a lookup that may hit is the one-row path's, even for a row that then fails
        stop = stop | (rows.active & ~without_hits)
    return jnp.where(jnp.any(stop), jnp.argmax(stop), num_rows).astype(jnp.int32)


def _count_lookups(pool: BlockPool, plan: RowPlan, rows: StepRows, served: Bool[Array, "R"]) -> BlockPool:
    """The prefix-cache statistics of the new requests the run served (each a lookup that found nothing), as the
    one-row path counts them."""
    searched = served & looks_up_prefix(rows, plan.is_new)
    stats = pool.stats
    counters = updated(
        pool.counters,
        {
            STAT_REQUESTS: stats.requests + jnp.sum(searched, dtype=jnp.int32),
            STAT_QUERIES: stats.queries + jnp.sum(jnp.where(searched, plan.stored.num_tokens, 0)),
        },
    )
    return dataclasses.replace(pool, counters=counters)


def allocate_leading_rows(
    config: AllocatorConfig,
    state: AllocatorState,
    rows: StepRows,
    *,
    maintain: bool = True,
    multi_block: bool = False,
) -> tuple[AllocatorState, RowResults, Int[Array, ""], Inserts]:
    """Serve the leading rows of `rows` ([R] each) that the vectorised path serves exactly.

    Returns (state, `RowResults`, index of the first row not served (R if none), prefix-map inserts left pending
    for the caller's rare path). With ``maintain=False`` no rare work is done: when the ring needs compaction or the
    stamps re-ranking, no row is served (the index is then 0). ``multi_block``: rows may take and cache several
    blocks per group, and new requests without a prefix hit are served too (see the module docstring).
    """
    requests, pool = state.requests, state.pool
    num_rows = rows.slot.shape[0]
    capacity = multi_block_capacity(config, num_rows) if multi_block else num_rows * config.num_groups
    slot_ok, slot, stored = gather_rows(config, requests, rows.slot)
    no_hit = jnp.zeros(num_rows, jnp.int32)
    plan = plan_rows(
        config, rows, slot_ok, slot, stored, no_hit, jnp.zeros((config.num_groups, num_rows), jnp.int32)
    )

    def enumerate_events(counts: Int[Array, "G R"]) -> commit_ops.Events:
        if multi_block:
            return commit_ops.expand_events(counts, capacity)
        return commit_ops.one_event_per_group(counts)

    frees = commit_ops.skipped_frees(config, pool, requests, plan, enumerate_events(plan.free_count))
    reaches_zero = _reaching_zero(pool, frees)
    without_hits = _without_hits(config, pool, requests, rows, plan) if multi_block else None
    first_stop = _first_stop(config, plan, rows, frees, reaches_zero, pool.num_free, without_hits)
    commit = plan.valid & (jnp.arange(num_rows) < first_stop)

    take_count = jnp.where(commit[None, :], plan.new_count, 0)
    appended = jnp.sum(reaches_zero & commit[frees.events.row], dtype=jnp.int32)
    compaction = pool_ops.needs_compaction(
        pool, appended=appended, count=jnp.sum(take_count), max_count=capacity
    )
    due = compaction | pool_ops.stamps_near_overflow(pool)
    if maintain:
        pool = commit_ops.maintain_pool(pool, compaction, due)
    else:  # commit nothing: the caller's loop does the rare work, then these rows
        commit = commit & ~due
        first_stop = jnp.where(due, 0, first_stop)
        take_count = jnp.where(commit[None, :], plan.new_count, 0)
    if multi_block and config.enable_caching:
        pool = _count_lookups(pool, plan, rows, rows.active & (jnp.arange(num_rows) < first_stop))
    pool, tables = commit_ops.release_skipped(
        config, pool, requests.tables.reshape(-1), frees, commit, unique=False, hashed_only=True
    )
    takes = enumerate_events(take_count)
    rank = cumsum(takes.present) - 1
    pool, tables = commit_ops.take_new_blocks(config, pool, tables, plan, take_count, takes, rank, capacity)
    inserts = Inserts.none(capacity)
    if config.enable_caching:  # colliding prefix-map inserts are left for the caller's rare path
        cache_count = jnp.where(commit[None, :], plan.cache_count, 0)
        caches = enumerate_events(cache_count)
        pool, inserts = commit_ops.cache_full_blocks(
            config, pool, requests, tables, plan, caches, finish=False
        )
    requests = commit_ops.write_request_rows(config, requests, plan, commit, tables)
    results = RowResults(commit, plan.computed, jnp.where(commit, plan.new_tokens, 0), no_hit)
    return AllocatorState(pool=pool, requests=requests), results, first_stop, inserts
