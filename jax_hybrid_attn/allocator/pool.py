"""Block-pool operations on `BlockPool`: free, touch (prefix hit), take, cache, reset; all traceable.

vLLM's `BlockPool` rules, as of vLLM 0.33:
  * The null block (`NULL_BLOCK_ID` = 0) is never in the free queue, never handed out, never freed or cached.
  * The free queue starts in ascending id order; `take` pops from the head. Taking a block that still holds a
    hash evicts that hash from the prefix map (lazy eviction: a freed block stays hittable until reused).
  * `free_blocks` receives blocks in order, as calls (one call per ``free_blocks`` of vLLM: one group of one
    request, tail block first). Blocks whose count reaches 0 and hold a hash are appended at the tail, in the
    given order (FIFO: cached blocks are evicted last); those without a hash (all of them when caching is off)
    are prepended at the head as a unit, in the given order (LIFO reuse). With several calls, a later call's
    prepended blocks end up in front of an earlier call's.
  * `touch` takes hit blocks out of the free queue when their count is 0, and counts them.

The queue is a ring with lazy deletion (see `BlockPool`): touch leaves a stale entry behind; `take` skips stale
entries; the ring is compacted (O(C)) only when stale entries crowd the head or the ring is full.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, UInt32

from ..constants import NULL_BLOCK_ID
from . import prefix_map
from .columns import (
    DROPPED,
    FREE_POS,
    GROUP,
    HASHED,
    MAP_SLOT,
    NO_GROUP,
    NO_MAP_SLOT,
    NOT_FREE,
    NUM_FREE,
    REF,
    RING_HEAD,
    RING_SPAN,
    STAMP,
    STAMP_COUNTER,
    BlockRows,
)
from .state import BlockPool
from .xla_cpu import cpu_cond, cumsum, materialize, run_if, run_or_select, updated

__all__ = [
    "cache_blocks",
    "compact",
    "finish_inserts",
    "free_blocks",
    "free_queue_order",
    "needs_compaction",
    "renormalize_stamps",
    "repeated_events",
    "reset_prefix_cache",
    "stamps_near_overflow",
    "take",
    "touch",
]

STAMP_RENORMALIZE_AT = 2**30
"""Insertion stamps are re-ranked before they could overflow int32."""


def _ring_window(ring, info, head, span, size: int):
    """The first `size` ring entries from the head: block ids, and which are live."""
    offset = jnp.arange(size, dtype=jnp.int32)
    index = (head + offset) & (ring.shape[0] - 1)
    entries = ring[index]
    return entries, (offset < span) & (BlockRows(info, entries).free_pos == index)


def _compact_ring(ring, info, head, span):
    """Drop stale entries: the live ones move, in order, to ring indices 0, 1, ..."""
    capacity, num_blocks = ring.shape[0], info.shape[0]
    entries, live = _ring_window(ring, info, head, span, capacity)
    new_index = cumsum(live) - 1
    ring = (
        jnp.full(capacity, NULL_BLOCK_ID, jnp.int32)
        .at[jnp.where(live, new_index, capacity)]
        .set(entries, mode="drop")
    )
    info = info.at[jnp.where(live, entries, num_blocks), FREE_POS].set(new_index, mode="drop")
    return ring, info, jnp.zeros((), jnp.int32), jnp.sum(live, dtype=jnp.int32)


def _ring(pool: BlockPool):
    return pool.ring, pool.info, pool.ring_head, pool.ring_span


def free_blocks(
    pool: BlockPool,
    blocks: Int[Array, "E"],
    mask: Bool[Array, "E"],
    calls: Int[Array, "E"],
    *,
    num_calls: int,
    unique: bool,
    hashed_only: bool = False,
    compact: bool = True,
) -> BlockPool:
    """Release one reference to each ``blocks[mask]``, in order; queue those that reach 0.

    Args:
      blocks, mask: events in order; a block may appear in several events unless `unique`.
      calls: [E] nondecreasing call index (< `num_calls`) of each event.
      hashed_only: the caller guarantees that every block reaching 0 holds a hash (all go to the tail).
      compact: compact the ring first if it would overflow (on a GPU without a host sync: the compaction always
        runs there and a select keeps it); False when the caller checked (`needs_compaction`).
    """
    num_events, num_blocks = blocks.shape[0], pool.info.shape[0]
    capacity = pool.ring.shape[0]
    mask = mask & (blocks != NULL_BLOCK_ID)
    rows, info = materialize((pool.info[blocks], pool.info))
    rows = BlockRows(rows)
    ref_before, hashed = rows.ref, rows.hashed
    if unique:
        count, last = jnp.ones_like(blocks), mask
    else:  # only blocks held more than once can appear twice
        count, last = cpu_cond(
            jnp.any(mask & (ref_before > 1)),
            lambda: repeated_events(blocks, mask, num_blocks),
            lambda: (jnp.ones_like(blocks), mask),
        )
    ref_after = ref_before - count
    queued = last & (ref_after == 0)
    to_tail = queued if hashed_only else queued & hashed
    num_tail = jnp.sum(to_tail, dtype=jnp.int32)
    num_head = jnp.zeros((), jnp.int32) if hashed_only else jnp.sum(queued & ~hashed, dtype=jnp.int32)
    added = num_tail + num_head
    ring, head, span = pool.ring, pool.ring_head, pool.ring_span
    if compact:
        ring, info, head, span = run_or_select(span + added > capacity, _compact_ring, ring, info, head, span)

    wrap = capacity - 1
    index = (head + span + cumsum(to_tail) - 1) & wrap
    new_head = head
    if not hashed_only:  # head: later calls in front; inside a call, the given order
        to_head = queued & ~hashed
        through = cumsum(to_head)
        before = through - to_head
        call_through = jnp.zeros(num_calls, jnp.int32).at[calls].max(through)
        call_before = jnp.full(num_calls, num_events, jnp.int32).at[calls].min(before)
        from_head = (num_head - call_through[calls]) + (before - call_before[calls])
        new_head = (head - num_head) & wrap
        index = jnp.where(to_tail, index, (new_head + from_head) & wrap)
    ring = ring.at[jnp.where(queued, index, capacity)].set(blocks, mode="drop")
    # One scatter writes REF and FREE_POS of each block (by its last event; the count already holds every event).
    values = jnp.stack([ref_after, jnp.where(queued, index, rows.free_pos)], axis=-1)
    info = info.at[jnp.where(last, blocks, num_blocks), REF : FREE_POS + 1].set(values, mode="drop")
    counters = updated(
        pool.counters, {RING_HEAD: new_head, RING_SPAN: span + added, NUM_FREE: pool.num_free + added}
    )
    return dataclasses.replace(pool, ring=ring, info=info, counters=counters)


def repeated_events(blocks: Int[Array, "E"], mask: Bool[Array, "E"], num_blocks: int):
    """For each event of ``blocks[mask]``: how many events name its block, and whether it is the block's last
    event (a block freed by several events drops one reference per event; its last event queues it)."""
    safe = jnp.where(mask, blocks, num_blocks)
    order = jnp.arange(blocks.shape[0], dtype=jnp.int32)
    count = jnp.zeros(num_blocks, jnp.int32).at[safe].add(1, mode="drop")
    latest = jnp.full(num_blocks, -1, jnp.int32).at[safe].max(order, mode="drop")
    return count[blocks], mask & (latest[blocks] == order)


def touch(pool: BlockPool, blocks: Int[Array, "E"], mask: Bool[Array, "E"]) -> BlockPool:
    """Take a reference to each prefix-hit block (distinct); a free one leaves the free queue (its ring entry
    goes stale)."""
    num_blocks = pool.info.shape[0]
    mask = mask & (blocks != NULL_BLOCK_ID)
    rows, info = materialize((pool.info[blocks], pool.info))
    ref = BlockRows(rows).ref
    was_free = mask & (ref == 0)
    values = jnp.stack([ref + 1, jnp.full_like(blocks, NOT_FREE)], axis=-1)
    info = info.at[jnp.where(mask, blocks, num_blocks), REF : FREE_POS + 1].set(values, mode="drop")
    counters = updated(pool.counters, {NUM_FREE: pool.num_free - jnp.sum(was_free, dtype=jnp.int32)})
    return dataclasses.replace(pool, info=info, counters=counters)


def needs_compaction(pool: BlockPool, *, appended: Int[Array, ""], count: Int[Array, ""], max_count: int):
    """Whether appending `appended` blocks at the tail, then taking `count` from a window of `max_count` entries,
    needs the ring compacted first (it overflows, or stale entries crowd the head)."""
    capacity = pool.ring.shape[0]
    head, span = pool.ring_head, pool.ring_span
    _, live = _ring_window(pool.ring, pool.info, head, span, max_count)
    live_after = jnp.sum(live, dtype=jnp.int32) + jnp.clip(
        max_count - span, 0, appended
    )  # appended ones are live
    return (span + appended > capacity) | (live_after < count)


def compact(pool: BlockPool) -> BlockPool:
    """Move the live free-queue entries, in order, to the start of the ring."""
    ring, info, head, span = _compact_ring(*_ring(pool))
    counters = updated(pool.counters, {RING_HEAD: head, RING_SPAN: span})
    return dataclasses.replace(pool, ring=ring, info=info, counters=counters)


def take(pool: BlockPool, count: Int[Array, ""], max_count: int):
    """Pop `count` (<= `max_count`, <= num_free) blocks from the head. Returns (pool, [max_count] ids).

    Entries past `count` are `NULL_BLOCK_ID`. Taken blocks get reference count 1 and lose their hash. The caller
    has made sure (`needs_compaction` on this very pool, after every touch, then `compact`) that the first
    `max_count` entries hold `count` live ones. The free count drops by the blocks actually taken, so it always
    equals the live entries of the queue.
    """
    num_blocks, capacity = pool.info.shape[0], pool.ring.shape[0]
    ring, info, head, span = _ring(pool)
    entries, live = _ring_window(ring, info, head, span, max_count)
    rank = cumsum(live) - 1
    taken = live & (rank < count)
    blocks = (
        jnp.full(max_count, NULL_BLOCK_ID, jnp.int32)
        .at[jnp.where(taken, rank, max_count)]
        .set(entries, mode="drop")
    )
    advance = jnp.max(jnp.where(taken, jnp.arange(1, max_count + 1, dtype=jnp.int32), 0), initial=0)
    got = jnp.arange(max_count) < count
    rows, info = materialize((info[blocks], info))
    rows = BlockRows(rows)
    fresh = jnp.asarray([1, NOT_FREE, 0, NO_GROUP, NO_MAP_SLOT], jnp.int32)  # REF .. MAP_SLOT
    info = info.at[jnp.where(got, blocks, num_blocks), REF : MAP_SLOT + 1].set(fresh, mode="drop")
    evict = got & rows.hashed
    counters = updated(
        pool.counters,
        {
            RING_HEAD: (head + advance) & (capacity - 1),
            RING_SPAN: span - advance,
            NUM_FREE: pool.num_free - jnp.sum(taken, dtype=jnp.int32),
        },
    )
    table = prefix_map.delete(pool.prefix_map, blocks, rows.map_slot, evict)
    return dataclasses.replace(pool, ring=ring, info=info, counters=counters, prefix_map=table), blocks


def stamps_near_overflow(pool: BlockPool) -> Bool[Array, ""]:
    """Whether the insertion stamps must be re-ranked before more blocks are cached (`renormalize_stamps`)."""
    return pool.stamp_counter >= STAMP_RENORMALIZE_AT


def renormalize_stamps(pool: BlockPool) -> BlockPool:
    """Re-rank the insertion stamps if they near overflow (check at least once per step: a step inserts far fewer
    than ``2**31 - STAMP_RENORMALIZE_AT`` blocks)."""
    info, counter = run_if(stamps_near_overflow(pool), _renormalize_stamps, pool.info, pool.stamp_counter)
    return dataclasses.replace(pool, info=info, counters=updated(pool.counters, {STAMP_COUNTER: counter}))


def _renormalize_stamps(info, counter):
    """Re-rank the insertion stamps of cached blocks from 0 (same order), before they overflow."""
    num_blocks = info.shape[0]
    blocks = BlockRows(info)
    hashed = blocks.hashed
    order = jnp.argsort(jnp.where(hashed, blocks.stamp, jnp.iinfo(jnp.int32).max))
    rank = jnp.zeros(num_blocks, jnp.int32).at[order].set(jnp.arange(num_blocks, dtype=jnp.int32))
    return info.at[:, STAMP].set(rank), jnp.sum(hashed, dtype=jnp.int32)


def cache_blocks(
    pool: BlockPool,
    blocks: Int[Array, "E"],
    keys: UInt32[Array, "E 2"],
    groups: Int[Array, "E"],
    mask: Bool[Array, "E"],
    tokens: Int[Array, "E S_max"] | None = None,
    *,
    finish: bool = True,
):
    """Give each ``blocks[mask]`` (full, not yet cached) its hash and insert it into the prefix map, in order.

    Returns the pool; with ``finish=False``, (pool, `prefix_map.Inserts`) with the inserts that still wait for a
    slot, to be completed by `finish_inserts` before the prefix map is read.
    """
    num_blocks = pool.info.shape[0]
    mask = mask & (blocks != NULL_BLOCK_ID)
    safe = jnp.where(mask, blocks, num_blocks)
    stamps = pool.stamp_counter + cumsum(mask) - 1
    table, inserts = prefix_map.insert(pool.prefix_map, blocks, keys, groups, mask, finish=finish)
    words = jax.lax.bitcast_convert_type(keys, jnp.int32)
    values = jnp.stack(
        [jnp.ones_like(blocks), groups, inserts.slot_of, stamps, words[:, 0], words[:, 1]], axis=-1
    )
    info = pool.info.at[safe, HASHED:].set(
        values, mode="drop"
    )  # HASHED, GROUP, MAP_SLOT, STAMP, HASH_HI, HASH_LO
    counters = updated(
        pool.counters,
        {
            STAMP_COUNTER: pool.stamp_counter + jnp.sum(mask, dtype=jnp.int32),
            DROPPED: pool.dropped_inserts + inserts.dropped,
        },
    )
    block_tokens = pool.block_tokens
    if tokens is not None and block_tokens.shape[1]:
        block_tokens = block_tokens.at[safe].set(tokens, mode="drop")
    pool = dataclasses.replace(
        pool, info=info, prefix_map=table, counters=counters, block_tokens=block_tokens
    )
    if finish:
        return pool
    return pool, dataclasses.replace(inserts, dropped=jnp.zeros((), jnp.int32))


def finish_inserts(pool: BlockPool, inserts: prefix_map.Inserts, *, max_rounds: int | None = None) -> BlockPool:
    """Place the inserts that `cache_blocks(finish=False)` left pending, and record their map slots
    (`prefix_map.finish_inserts`: `max_rounds` bounds the rounds, dropping what is left)."""
    table, done = prefix_map.finish_inserts(pool.prefix_map, inserts, max_rounds=max_rounds)
    placed = inserts.pending & (done.slot_of != NO_MAP_SLOT)
    info = pool.info.at[jnp.where(placed, done.blocks, pool.info.shape[0]), MAP_SLOT].set(
        done.slot_of, mode="drop"
    )
    counters = updated(pool.counters, {DROPPED: pool.dropped_inserts + done.dropped})
    return dataclasses.replace(pool, info=info, prefix_map=table, counters=counters)


def reset_prefix_cache(pool: BlockPool):
    """Forget every hash, if no block is in use. Returns (pool, whether it was reset)."""
    ok = pool.num_free == pool.info.shape[0] - 1
    forgotten = pool.info.at[:, HASHED].set(0).at[:, MAP_SLOT].set(NO_MAP_SLOT).at[:, GROUP].set(NO_GROUP)
    empty = jnp.full_like(pool.prefix_map, prefix_map.EMPTY_SLOT).at[:, -1].set(0)
    info = jnp.where(ok, forgotten, pool.info)
    return dataclasses.replace(pool, info=info, prefix_map=jnp.where(ok, empty, pool.prefix_map)), ok


def free_queue_order(pool: BlockPool) -> list[int]:
    """The free queue from head (next evicted) to tail, on the host (for tests and debugging)."""
    ring, free_pos = np.asarray(pool.ring), np.asarray(pool.free_pos)
    head, span = int(pool.ring_head), int(pool.ring_span)
    index = (head + np.arange(span)) % ring.shape[0]
    return [int(b) for b, i in zip(ring[index], index) if free_pos[b] == i]
