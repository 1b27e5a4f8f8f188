"""The step's general path: one row of any kind, in vLLM's order.

It serves what the vectorised path (`vectorised`) cannot: a request that holds no blocks (it looks up its prefix
first), a row that frees an unhashed block or several blocks in a group, takes or caches several blocks in a
group, or fails. Its events are enumerated into `AllocatorConfig.max_row_step_blocks` slots; a row that would need
more fails (its computed tokens jumped further than one scheduler step moves them).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..constants import NULL_BLOCK_ID
from . import commit as commit_ops
from . import pool as pool_ops
from .columns import STAT_HITS, STAT_QUERIES, STAT_REQUESTS, BlockRows
from .config import AllocatorConfig
from .coordinator import compute_hits, may_hit
from .row_plan import RowPlan, RowResults, StepRows, gather_rows, looks_up_prefix, plan_rows
from .state import AllocatorState, BlockPool, RequestTable
from .xla_cpu import updated

__all__ = ["allocate_one_row"]


@dataclasses.dataclass(frozen=True)
class _PrefixHit:
    """The row's prefix hit: tokens [1], first real block per group [G, 1], hit lists [G, 1, P_max]."""

    tokens: Int[Array, "1"]
    first_real: Int[Array, "G 1"]
    lists: Int[Array, "G 1 P_max"]


def _search_prefix(
    config: AllocatorConfig, pool: BlockPool, requests: RequestTable, row: StepRows, slot_ok, slot, stored
) -> tuple[BlockPool, _PrefixHit]:
    """Look up the prefix of a request that holds no blocks and starts from token 0 (hits capped at
    ``num_tokens - 1``), and count the lookup in the prefix-cache statistics. Returns (pool, hit)."""
    num_tokens = stored.num_tokens[0]
    search = (row.active & slot_ok & looks_up_prefix(row, ~stored.running))[0]
    # A prompt whose first block misses in a full-attention group has no hit: skip the search.
    lookup = search & may_hit(config, pool, requests, slot[0], num_tokens - 1)

    def do_search(_):
        return compute_hits(config, pool, requests, slot[0], num_tokens - 1)

    def no_search(_):
        nulls = jnp.full((config.num_groups, config.max_blocks_per_row), NULL_BLOCK_ID, jnp.int32)
        return jnp.zeros((), jnp.int32), nulls, jnp.zeros(config.num_groups, jnp.int32)

    found, lists, first_real = jax.lax.cond(lookup, do_search, no_search, None)
    stats = pool.stats
    counters = updated(
        pool.counters,
        {
            STAT_REQUESTS: stats.requests + search.astype(jnp.int32),
            STAT_QUERIES: stats.queries + jnp.where(search, num_tokens, 0),
            STAT_HITS: stats.hits + jnp.where(search, found, 0),
        },
    )
    pool = dataclasses.replace(pool, counters=counters)
    return pool, _PrefixHit(found[None], first_real[:, None], lists[:, None, :])


def _touches(config: AllocatorConfig, pool: BlockPool, plan: RowPlan, hit: _PrefixHit):
    """The hit blocks the row touches if it is served ([G, 1, P_max] mask: real blocks inside the window or chunk),
    and how many of them sit in the free queue ([1])."""
    column = jnp.arange(config.max_blocks_per_row, dtype=jnp.int32)
    touch_from = jnp.maximum(plan.skipped, hit.first_real)
    touch_mask = (
        (column >= touch_from[..., None])
        & (column < plan.hit_blocks[..., None])
        & (hit.lists != NULL_BLOCK_ID)
        & plan.valid[None, :, None]
    )
    was_free = touch_mask & (BlockRows(pool.info, hit.lists).ref == 0)
    return touch_mask, jnp.sum(was_free, axis=(0, 2), dtype=jnp.int32)


def allocate_one_row(config: AllocatorConfig, state: AllocatorState, row: StepRows):
    """Allocate for one row (`row`: each field [1]). Returns (state, `RowResults` [1]).

    Order: prefix lookup; plan; admission (the free room counts the blocks this row frees, and hit blocks that sit
    in the free queue count as taken); then touch the hits, compact the ring or re-rank stamps if due, free, write
    the hits into the table, take, cache, write the request row. The touch comes before the compaction check: hit
    blocks leave the free queue and leave stale entries (anywhere in the ring, the take window included) that the
    check must see, or `take` could hand out the null block. A row that touches is a new request, which frees
    nothing, so touches and frees never meet in one row.
    """
    requests, pool = state.requests, state.pool
    capacity = config.max_row_step_blocks
    slot_ok, slot, stored = gather_rows(config, requests, row.slot)
    hit = None
    if config.enable_caching:
        pool, hit = _search_prefix(config, pool, requests, row, slot_ok, slot, stored)
        plan = plan_rows(config, row, slot_ok, slot, stored, hit.tokens, hit.first_real)
    else:
        zeros = jnp.zeros((config.num_groups, 1), jnp.int32)
        plan = plan_rows(config, row, slot_ok, slot, stored, jnp.zeros(1, jnp.int32), zeros)

    evictable = jnp.zeros(1, jnp.int32)  # hit blocks in the free queue: touching takes them out of it
    if hit is not None:
        touch_mask, evictable = _touches(config, pool, plan, hit)

    frees = commit_ops.skipped_frees(
        config, pool, requests, plan, commit_ops.expand_events(plan.free_count, capacity)
    )
    num_free = pool.num_free
    reaches_zero = frees.real & (frees.info.ref == 1)  # a row's events name distinct blocks
    free_room = num_free + jnp.sum(reaches_zero, dtype=jnp.int32)
    fits = (  # every event has a slot (`AllocatorConfig.max_row_step_blocks`)
        (jnp.sum(plan.free_count) <= capacity)
        & (jnp.sum(plan.new_count) <= capacity)
        & (jnp.sum(plan.cache_count) <= capacity)
    )
    gate_ok = ~row.must_fit | (plan.gate_blocks + evictable <= num_free)
    commit = plan.valid & fits & (plan.new_blocks + evictable <= free_room) & gate_ok

    take_count = jnp.where(commit[None, :], plan.new_count, 0)
    if hit is not None:
        touch_now = touch_mask & commit[None, :, None]
        pool = pool_ops.touch(pool, hit.lists.reshape(-1), touch_now.reshape(-1))
    appended = jnp.sum(reaches_zero & commit[frees.events.row], dtype=jnp.int32)
    compaction = pool_ops.needs_compaction(
        pool, appended=appended, count=jnp.sum(take_count), max_count=capacity
    )
    pool = commit_ops.maintain_pool(pool, compaction, compaction | pool_ops.stamps_near_overflow(pool))
    pool, tables = commit_ops.release_skipped(
        config, pool, requests.tables.reshape(-1), frees, commit, unique=True, hashed_only=False
    )
    if hit is not None:  # the touched hits into the table
        group = jnp.broadcast_to(jnp.arange(config.num_groups)[:, None, None], hit.lists.shape)
        column = jnp.arange(config.max_blocks_per_row, dtype=jnp.int32)
        hit_index = commit_ops.table_index(config, group, slot[None, :, None], column)
        tables = tables.at[jnp.where(touch_now, hit_index, tables.shape[0])].set(hit.lists, mode="drop")
    takes = commit_ops.expand_events(take_count, capacity)
    pool, tables = commit_ops.take_new_blocks(
        config, pool, tables, plan, take_count, takes, jnp.arange(capacity), capacity
    )
    if config.enable_caching:
        caches = commit_ops.expand_events(jnp.where(commit[None, :], plan.cache_count, 0), capacity)
        pool = commit_ops.cache_full_blocks(config, pool, requests, tables, plan, caches, finish=True)
    requests = commit_ops.write_request_rows(config, requests, plan, commit, tables)
    scheduled = jnp.where(commit, plan.new_tokens, 0)
    hit_tokens = jnp.zeros(1, jnp.int32) if hit is None else hit.tokens
    results = RowResults(commit, plan.computed, scheduled, hit_tokens)
    return AllocatorState(pool=pool, requests=requests), results
