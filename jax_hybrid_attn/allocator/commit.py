"""Committing planned rows (`row_plan.RowPlan`): their events into the pool and their new tables and request rows.

Events go in vLLM's order: row, then group, then block index (frees from the highest index down); the frees of
one (row, group) are one vLLM ``free_blocks`` call. The one-row path enumerates its row's events from the counts
into `AllocatorConfig.max_row_step_blocks` slots (`expand_events`), and the vectorised path its takes and caches
into `vectorised.multi_block_capacity` slots when its rows may need several blocks; otherwise it has one event slot
per (row, group) (`one_event_per_group`), since its rows then free, take and cache at most one block per group.

Block tables are written through a flat view (``tables.reshape(-1)``, [G * R_slots * P_max], written GRP in the
annotations; indices from `table_index`): one cheap 1-D gather or scatter each. E is the number of event slots.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..constants import NULL_BLOCK_ID
from . import pool as pool_ops
from .columns import ADAPTER, ROW_GROUP_COLUMNS, RUNNING, BlockRows
from .config import AllocatorConfig
from .group_rules import cacheable_mask, group_constants
from .row_plan import RowPlan
from .state import BlockPool, RequestTable
from .xla_cpu import cumsum, run_if

__all__ = [
    "Events",
    "Frees",
    "cache_full_blocks",
    "expand",
    "expand_events",
    "maintain_pool",
    "one_event_per_group",
    "release_skipped",
    "skipped_frees",
    "table_index",
    "take_new_blocks",
    "write_request_rows",
]


def table_index(config: AllocatorConfig, group, slot, column):
    """Flat index into ``tables.reshape(-1)`` of ``tables[group, slot, column]``."""
    return (group * config.max_num_seqs + slot) * config.max_blocks_per_row + column


def expand(counts: Int[Array, "N"], capacity: int, ends: Int[Array, "N"] | None = None):
    """Enumerate ``counts[i]`` events for each i, in order, into `capacity` slots (`ends`: ``cumsum(counts)``, if
    the caller has it). Returns (segment i of each event, its index inside the segment, whether the slot holds an
    event), [capacity] each."""
    ends = cumsum(counts) if ends is None else ends
    starts = ends - counts
    marks = jnp.zeros(capacity, jnp.int32).at[starts].add(1, mode="drop")
    segment = jnp.clip(cumsum(marks) - 1, 0, counts.shape[0] - 1)
    event = jnp.arange(capacity, dtype=jnp.int32)
    return segment, event - starts[segment], event < ends[-1]


@dataclasses.dataclass(frozen=True)
class Events:
    """Event slots, [E] each: row and group of the event, its index among that (row, group)'s events, and
    whether the slot holds an event."""

    row: Int[Array, "E"]
    group: Int[Array, "E"]
    index: Int[Array, "E"]
    present: Bool[Array, "E"]


def expand_events(counts: Int[Array, "G R"], capacity: int) -> Events:
    """``counts[g, r]`` events for each (row, group), in order, in `capacity` slots."""
    num_groups = counts.shape[0]
    call, index, present = expand(counts.T.reshape(-1), capacity)
    return Events(call // num_groups, call % num_groups, index, present)


def one_event_per_group(counts: Int[Array, "G R"]) -> Events:
    """One slot per (row, group), holding an event when its count is positive (the vectorised path)."""
    num_groups, num_rows = counts.shape
    call = jnp.arange(num_rows * num_groups, dtype=jnp.int32)
    return Events(call // num_groups, call % num_groups, jnp.zeros_like(call), counts.T.reshape(-1) > 0)


@dataclasses.dataclass(frozen=True)
class Frees:
    """Freeing events (skipped blocks), [E] each: where in the flat tables, which block, and that block's fields."""

    events: Events
    table_index: Int[Array, "E"]
    block: Int[Array, "E"]
    real: Bool[Array, "E"]  # a present event whose block is not the null block
    info: BlockRows  # the blocks' rows of `BlockPool.info`


def skipped_frees(
    config: AllocatorConfig, pool: BlockPool, requests: RequestTable, plan: RowPlan, events: Events
):
    """The blocks that `events` free: column ``freeable - 1 - index`` of each (row, group), highest first."""
    position = plan.freeable[events.group, events.row] - 1 - events.index
    column = jnp.clip(position, 0, config.max_blocks_per_row - 1)
    index = table_index(config, events.group, plan.slot[events.row], column)
    block = requests.tables.reshape(-1)[index]
    real = events.present & (block != NULL_BLOCK_ID)
    return Frees(events, index, block, real, BlockRows(pool.info[block]))


def maintain_pool(pool: BlockPool, compaction: Bool[Array, ""], due: Bool[Array, ""]) -> BlockPool:
    """The rare work, behind one check (one host sync on a GPU): ring compaction, then stamp re-ranking."""

    def do_maintain(pool):
        pool = run_if(compaction, lambda pool: (pool_ops.compact(pool),), pool)[0]
        return (pool_ops.renormalize_stamps(pool),)

    return run_if(due, do_maintain, pool)[0]


def release_skipped(
    config: AllocatorConfig,
    pool: BlockPool,
    flat_tables: Int[Array, "GRP"],
    frees: Frees,
    commit: Bool[Array, "R"],
    *,
    unique: bool,
    hashed_only: bool,
):
    """Free the committed rows' skipped blocks (`pool.free_blocks`, one call per (row, group); the ring was
    compacted before if needed) and put the null block in their columns. Returns (pool, tables)."""
    events, num_groups = frees.events, config.num_groups
    committed = frees.real & commit[events.row]
    flat_tables = flat_tables.at[jnp.where(committed, frees.table_index, flat_tables.shape[0])].set(
        NULL_BLOCK_ID, mode="drop"
    )
    pool = pool_ops.free_blocks(
        pool,
        frees.block,
        committed,
        events.row * num_groups + events.group,
        num_calls=commit.shape[0] * num_groups,
        unique=unique,
        hashed_only=hashed_only,
        compact=False,
    )
    return pool, flat_tables


def take_new_blocks(
    config: AllocatorConfig,
    pool: BlockPool,
    flat_tables: Int[Array, "GRP"],
    plan: RowPlan,
    take_count: Int[Array, "G R"],
    events: Events,
    rank: Int[Array, "E"],
    capacity: int,
):
    """Take ``sum(take_count)`` blocks from the head of the free queue into columns ``base_len + index`` of each
    event's (row, group); event e gets the ``rank[e]``-th block taken. Returns (pool, tables)."""
    pool, taken = pool_ops.take(pool, jnp.sum(take_count), capacity)
    position = plan.base_len[events.group, events.row] + events.index
    column = jnp.clip(position, 0, config.max_blocks_per_row - 1)
    index = table_index(config, events.group, plan.slot[events.row], column)
    flat_tables = flat_tables.at[jnp.where(events.present, index, flat_tables.shape[0])].set(
        taken[rank], mode="drop"
    )
    return pool, flat_tables


def cache_full_blocks(
    config: AllocatorConfig,
    pool: BlockPool,
    requests: RequestTable,
    flat_tables: Int[Array, "GRP"],
    plan: RowPlan,
    events: Events,
    *,
    finish: bool,
):
    """Offer block ``cache_from + index`` of each event's (row, group) to the prefix cache (`pool.cache_blocks`;
    with ``finish=False`` it also returns the prefix-map inserts left pending)."""
    slot, group = plan.slot[events.row], events.group
    position = plan.cache_from[group, events.row] + events.index
    column = jnp.clip(position, 0, config.max_blocks_per_row - 1)
    block = flat_tables[table_index(config, group, slot, column)]
    sizes = set(config.block_sizes)
    if len(sizes) == 1:  # one block size: Python constants, no per-event lookups or divisions
        (block_size,) = sizes
        scale, mask = block_size // config.hash_block_size, events.present
    else:
        c = group_constants(config).of(group)
        block_size, scale = c.block_size, c.hash_scale
        mask = events.present & cacheable_mask(c, position, config.alignment)
    key_index = jnp.clip((position + 1) * scale - 1, 0, config.hash_blocks_per_row - 1)
    flat_hashes = requests.block_hashes.reshape(-1, 2)  # a 1-D row gather is cheaper than a 2-D one
    keys = flat_hashes[slot * config.hash_blocks_per_row + key_index]
    tokens = None
    if config.verify_hits:
        offset = jnp.arange(config.stored_block_tokens, dtype=jnp.int32)
        size = jnp.reshape(block_size, (-1, 1))
        token_pos = jnp.clip(position[:, None] * size + offset, 0, config.max_model_len - 1)
        tokens = jnp.where(offset < size, requests.token_ids[slot[:, None], token_pos], 0)
    return pool_ops.cache_blocks(pool, block, keys, group, mask, tokens, finish=finish)


def write_request_rows(
    config: AllocatorConfig,
    requests: RequestTable,
    plan: RowPlan,
    commit: Bool[Array, "R"],
    flat_tables: Int[Array, "GRP"],
) -> RequestTable:
    """The committed rows' request rows (running, new per-group counters) and the new block tables."""
    row = plan.stored.packed
    new_row = jnp.concatenate(
        [
            row[:, :RUNNING],
            jnp.ones_like(row[:, RUNNING:ADAPTER]),
            row[:, ADAPTER:ROW_GROUP_COLUMNS],
            plan.len_after.T,
            plan.null_after.T,
            plan.cached_after.T,
        ],
        axis=1,
    )
    rows = requests.rows.at[jnp.where(commit, plan.slot, config.max_num_seqs)].set(new_row, mode="drop")
    return dataclasses.replace(requests, tables=flat_tables.reshape(requests.tables.shape), rows=rows)
