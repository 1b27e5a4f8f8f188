"""The step's vectorised path: a run of rows served at once, exactly as the one-row path would serve them in turn.

It serves the leading rows of a chunk that are running requests which free only hashed blocks and need at most one
new block and one cached block per group, and fit. Each (row, group) is then one event slot. Hashed blocks go to
the tail of the free queue, so taking every row's new blocks from the head in row order is what the sequential
loop does; the free room each row sees is a prefix sum over the rows before it (plus the blocks its own frees
return). The first row that does not qualify stops the run; the caller serves it with the one-row path
(`single_row`), then resumes here after it.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from . import commit as commit_ops
from . import pool as pool_ops
from .config import AllocatorConfig
from .prefix_map import Inserts
from .row_plan import RowPlan, RowResults, StepRows, gather_rows, plan_rows
from .state import AllocatorState, BlockPool
from .xla_cpu import cpu_cond, cumsum

__all__ = ["allocate_leading_rows"]


def _reaching_zero(pool: BlockPool, frees: commit_ops.Frees) -> Bool[Array, "E"]:
    """Whether each free event's block reaches reference count 0: a block held by several of the rows does so at
    its last event, if every holder frees it."""
    real, ref_before = frees.real, frees.info.ref

    def exact():
        count, last = pool_ops.repeated_events(frees.block, real, pool.info.shape[0])
        return last & (ref_before == count)

    return cpu_cond(jnp.any(real & (ref_before > 1)), exact, lambda: real & (ref_before == 1))


def _first_stop(
    plan: RowPlan,
    rows: StepRows,
    frees: commit_ops.Frees,
    reaches_zero: Bool[Array, "E"],
    num_free: Int[Array, ""],
) -> Int[Array, ""]:
    """Index of the first valid row that this path cannot serve exactly (R if none): it does not fit in the free
    room left by the rows before it, is a new request, frees an unhashed block, or frees, takes or caches more than
    one block in a group."""
    num_groups, num_rows = plan.free_count.shape
    freed = jnp.sum(reaches_zero.reshape(num_rows, num_groups), axis=1, dtype=jnp.int32)
    unhashed = jnp.any((frees.real & ~frees.info.hashed).reshape(num_rows, num_groups), axis=1)
    need = plan.new_blocks
    delta = jnp.where(plan.valid, freed - need, 0)
    free_before = num_free + cumsum(delta) - delta  # free blocks when the row's turn comes
    fits = plan.valid & (need <= free_before + freed) & (~rows.must_fit | (plan.gate_blocks <= free_before))
    one_each = jnp.all((plan.free_count <= 1) & (plan.new_count <= 1) & (plan.cache_count <= 1), axis=0)
    stop = plan.valid & ~(fits & plan.stored.running & ~unhashed & one_each)
    return jnp.where(jnp.any(stop), jnp.argmax(stop), num_rows).astype(jnp.int32)


def allocate_leading_rows(
    config: AllocatorConfig, state: AllocatorState, rows: StepRows, *, maintain: bool = True
) -> tuple[AllocatorState, RowResults, Int[Array, ""], Inserts]:
    """Serve the leading rows of `rows` ([R] each) that the vectorised path serves exactly.

    Returns (state, `RowResults`, index of the first row not served (R if none), prefix-map inserts left pending
    for the caller's rare path). With ``maintain=False`` no rare work is done: when the ring needs compaction or the
    stamps re-ranking, no row is served (the index is then 0).
    """
    requests, pool = state.requests, state.pool
    num_rows, capacity = rows.slot.shape[0], rows.slot.shape[0] * config.num_groups
    slot_ok, slot, stored = gather_rows(config, requests, rows.slot)
    no_hit = jnp.zeros(num_rows, jnp.int32)
    plan = plan_rows(
        config, rows, slot_ok, slot, stored, no_hit, jnp.zeros((config.num_groups, num_rows), jnp.int32)
    )
    frees = commit_ops.skipped_frees(
        config, pool, requests, plan, commit_ops.one_event_per_group(plan.free_count)
    )
    reaches_zero = _reaching_zero(pool, frees)
    first_stop = _first_stop(plan, rows, frees, reaches_zero, pool.num_free)
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
    pool, tables = commit_ops.release_skipped(
        config, pool, requests.tables.reshape(-1), frees, commit, unique=False, hashed_only=True
    )
    takes = commit_ops.one_event_per_group(take_count)
    rank = cumsum(takes.present) - 1
    pool, tables = commit_ops.take_new_blocks(config, pool, tables, plan, take_count, takes, rank, capacity)
    inserts = Inserts.none(capacity)
    if config.enable_caching:  # colliding prefix-map inserts are left for the caller's rare path
        caches = commit_ops.one_event_per_group(jnp.where(commit[None, :], plan.cache_count, 0))
        pool, inserts = commit_ops.cache_full_blocks(
            config, pool, requests, tables, plan, caches, finish=False
        )
    requests = commit_ops.write_request_rows(config, requests, plan, commit, tables)
    results = RowResults(commit, plan.computed, jnp.where(commit, plan.new_tokens, 0), no_hit)
    return AllocatorState(pool=pool, requests=requests), results, first_stop, inserts
