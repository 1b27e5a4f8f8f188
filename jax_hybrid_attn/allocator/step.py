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
`row_plan` holds this arithmetic, `commit` the events it sends into the pool.

How the rows go (the step is a few hundred array operations whatever R is; `xla_cpu` says why that matters):
  * Rows with nothing to do this step (a decode that neither crosses a block edge nor frees nor caches a block)
    succeed without any work (`row_plan.idle_rows`).
  * The others go in order, up to `CHUNK_ROWS` at a time, through the vectorised path (`vectorised`), which
    serves a leading run of rows that free only hashed blocks, at most one per group. The first chunk, outside any
    loop, takes running requests that need at most one new and one cached block per group (a decode step); the
    loop after it also takes rows that need several blocks (prefill chunks) and new requests that surely miss the
    prefix cache.
  * The first row that path cannot serve exactly (a new request that may hit, a row that frees an unhashed block
    or several blocks, a row that fails) goes alone through the general one-row path (`single_row`); then the
    vectorised path resumes after it.
  * Rare work sits in 0-or-1-trip loops (`xla_cpu.run_if`). On a GPU each such check is a host sync of its
    predicate, so an iteration has two: ring compaction with stamp re-ranking before the frees and takes (one check
    for both, in either path), then prefix-map inserts that collided together with the one-row path.
  * With ``defer_rest`` only the first chunk runs, without rare work, and the rows it does not serve are deferred
    (`StepOutput.deferred`): the step then has no host sync at all, which lets a serving loop queue decode steps
    on a GPU back to back; with ``first_chunk_multi_block`` that chunk serves prefill chunks and new requests that
    surely miss too, so that prefill steps queue the same way.
  * On a CPU, `kv_cache_manager.compile_allocate_slots` compiles the step with one task per memory-bound operation.

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
    from position n, at least ``W - 1``; `group_rules.in_window_chunk`). No block is then allocated and freed
    again one step later, every token has a cache slot (the kernels read this step's keys from the cache), and the
    peak per request drops from ``cdiv(W - 1 + T, S) + 1`` to ``2 * (cdiv(W - 1, S) + 1)`` (plus lookahead). For a
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
from ..integers import check_bool, check_int
from . import pool as pool_ops
from .columns import ROW_GROUP_COLUMNS, RUNNING, RequestRows
from .commit import expand, table_index
from .config import AllocatorConfig, check_config
from .coordinator import compute_hits
from .group_rules import in_window_chunk, per_block
from .prefix_map import Inserts
from .row_plan import RowResults, StepRows, idle_rows
from .single_row import allocate_one_row
from .state import AllocatorState
from .vectorised import allocate_leading_rows
from .xla_cpu import cumsum, run_if

__all__ = ["StepOutput", "allocate_slots", "free", "get_computed_blocks", "reset_prefix_cache", "usage"]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one `allocate_slots` call scheduled, as device arrays ready for the kernels (R = batch rows).

    Attributes:
      success: [R] bool, the row got its blocks (False for padding rows and rows that did not fit).
      deferred: [R] bool, the row was not tried (``defer_rest``): it changed nothing and may succeed in a later
        call. Always False without ``defer_rest``.
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
    deferred: Bool[Array, "R"]
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

CHUNK_ROWS = 64
"""Rows the vectorised path serves per iteration (rows with nothing to do are skipped before)."""

DEFERRED_STEP_INSERT_ROUNDS = 4
"""With ``defer_rest``, the prefix-map insert rounds of a step (inserts that collide in more are dropped)."""


class _RowLoop:
    """The rows with work, in order: chunks through the vectorised path, the rows it stops at through the one-row
    path (C = `chunk` rows per chunk)."""

    def __init__(self, config: AllocatorConfig, rows: StepRows):
        self.config, self.rows = config, rows
        self.num_rows = rows.slot.shape[0]
        self.chunk = min(self.num_rows, CHUNK_ROWS)
        self.packed = rows.pack()

    def rows_at(self, members: Int[Array, "C"]) -> StepRows:
        """The rows `members` (``num_rows``: padding); one gather for every field."""
        gathered = StepRows.unpack(self.packed[jnp.minimum(members, self.num_rows - 1)])
        return dataclasses.replace(gathered, active=members < self.num_rows)

    def queue(self, work: Bool[Array, "R"]) -> Int[Array, "R+C"]:
        """The rows with work, in order, then ``num_rows`` (padding)."""
        num_rows, chunk = self.num_rows, self.chunk
        position = jnp.where(work, cumsum(work) - 1, num_rows + chunk)
        return (
            jnp.full(num_rows + chunk, num_rows, jnp.int32)
            .at[position]
            .set(jnp.arange(num_rows, dtype=jnp.int32))
        )

    def record(self, members, served: RowResults, results: RowResults) -> RowResults:
        """The vectorised path's results of rows `members` into `results` (only success and scheduled change)."""
        where_ok = jnp.where(served.success, members, self.num_rows)
        return dataclasses.replace(
            results,
            success=results.success.at[where_ok].set(True, mode="drop"),
            scheduled=results.scheduled.at[where_ok].set(served.scheduled, mode="drop"),
        )

    def one_row(self, row, state: AllocatorState, results: RowResults):
        """Row `row` through the general path."""
        state, served = allocate_one_row(self.config, state, self.rows.at(row))
        results = jax.tree.map(
            lambda arr, value: arr.at[row].set(value[0].astype(arr.dtype)), results, served
        )
        return state, results

    def step(self, work: Bool[Array, "R"], carry):
        """One iteration over the rows marked in `work`, from the `k`-th: the prefix-map inserts left pending, then a
        chunk of the queue through the vectorised path (several blocks a row, new requests without a prefix hit),
        then the row it stopped at through the general path, and the rare work (collided prefix-map inserts) behind
        the same check."""
        k, state, inserts, results = carry
        num_rows = self.num_rows
        pool = run_if(  # the inserts left by the first chunk
            jnp.any(inserts.pending), lambda pool: (pool_ops.finish_inserts(pool, inserts),), state.pool
        )[0]
        state = dataclasses.replace(state, pool=pool)
        members = jax.lax.dynamic_slice_in_dim(self.queue(work), k, self.chunk)
        state, served, stop, run_inserts = allocate_leading_rows(
            self.config, state, self.rows_at(members), multi_block=True
        )
        results = self.record(members, served, results)
        stop_row = jnp.where(stop < self.chunk, members[jnp.minimum(stop, self.chunk - 1)], num_rows)

        def rare(state, results):  # one host sync on a GPU for both kinds of rare work
            state = dataclasses.replace(state, pool=pool_ops.finish_inserts(state.pool, run_inserts))
            return run_if(stop_row < num_rows, partial(self.one_row, stop_row), state, results)

        state, results = run_if((stop_row < num_rows) | jnp.any(run_inserts.pending), rare, state, results)
        k = jnp.where(stop < self.chunk, k + stop + 1, k + self.chunk)
        return k, state, Inserts.none(inserts.pending.shape[0]), results


def _allocate_rows(config: AllocatorConfig, state: AllocatorState, rows: StepRows, *, defer_rest: bool = False,
                   first_chunk_multi_block: bool = False):  # fmt: skip
    """Serve every row in order (`defer_rest`: only the first chunk; `first_chunk_multi_block`: that chunk as the
    loop's; see `allocate_slots`). Returns (state, `RowResults`, [R] rows deferred)."""
    num_rows = rows.slot.shape[0]
    idle, bad = idle_rows(config, state, rows)
    results = RowResults(
        success=idle,
        computed=jnp.where(bad, 0, rows.num_computed),
        scheduled=jnp.where(idle, in_window_chunk(config, rows.num_computed, rows.num_new), 0),
        hits=jnp.zeros(num_rows, jnp.int32),
    )
    work = ~idle & ~bad
    # The first chunk of rows with work, outside any loop and without rare work: in the common step this serves
    # every row, and the loop below does not run (on a GPU its condition is then the step's only host sync).
    loop = _RowLoop(config, rows)
    # With a multi-block first chunk a deferring step runs no loop after it: that chunk takes every row
    first_chunk = num_rows if defer_rest and first_chunk_multi_block else loop.chunk
    members = loop.queue(work)[:first_chunk]
    state, served, _, inserts = allocate_leading_rows(
        config, state, loop.rows_at(members), maintain=False, multi_block=first_chunk_multi_block
    )
    results = loop.record(members, served, results)
    work = work & ~results.success  # rows left for the loop, which rebuilds their queue when it runs (rarely)
    if defer_rest:
        pool = pool_ops.finish_inserts(state.pool, inserts, max_rounds=DEFERRED_STEP_INSERT_ROUNDS)
        return dataclasses.replace(state, pool=pool), results, work
    count = jnp.sum(work, dtype=jnp.int32)
    carry = (jnp.zeros((), jnp.int32), state, inserts, results)
    _, state, _, results = jax.lax.while_loop(
        lambda c: (c[0] < count) | jnp.any(c[2].pending), partial(loop.step, work), carry
    )
    return state, results, jnp.zeros_like(work)


def _outputs(
    config: AllocatorConfig,
    state: AllocatorState,
    rows: StepRows,
    results: RowResults,
    deferred: Bool[Array, "R"],
    *,
    num_tokens: int,
    block_tables: bool,
) -> StepOutput:
    """The step's outputs from the rows' results and the new state (T = `num_tokens`)."""
    req = state.requests
    computed, scheduled = results.computed, results.scheduled
    slot_ok = (rows.slot >= 0) & (rows.slot < config.max_num_seqs)
    slot = jnp.clip(rows.slot, 0, config.max_num_seqs - 1)
    ends = cumsum(scheduled)
    row, index, token_ok = expand(scheduled, num_tokens, ends)
    position = jnp.where(token_ok, computed[row] + index, 0)
    token_slot = slot[row]
    known = position < RequestRows(req.rows, token_slot).num_tokens
    token_ids = jnp.where(token_ok & known, req.token_ids[token_slot, position], 0)
    groups = jnp.arange(config.num_groups, dtype=jnp.int32)[:, None]
    column = per_block(config, position)  # [G, T]
    block = req.tables.reshape(-1)[table_index(config, groups, token_slot[None, :], column)]  # one gather
    block_size = jnp.asarray(config.block_sizes, jnp.int32)[:, None]
    offset = position[None, :] - column * block_size
    mapping = jnp.where(token_ok & (block != NULL_BLOCK_ID), block * block_size + offset, PAD_SLOT_ID)
    tables = None
    if block_tables:  # one gather for all groups (a tuple of per-group tables would cost a copy each)
        # Padding rows read past the end: null blocks.
        rows_or_out = jnp.where(slot_ok, slot, config.max_num_seqs)
        tables = req.tables.at[:, rows_or_out].get(mode="fill", fill_value=NULL_BLOCK_ID)
    return StepOutput(
        success=results.success,
        deferred=deferred,
        num_computed_tokens=computed,
        num_new_computed_tokens=results.hits,
        num_scheduled_tokens=scheduled,
        query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32), ends]),
        seq_lens=computed + scheduled,
        positions=position,
        token_ids=token_ids,
        block_tables=tables,
        slot_mappings=mapping,
    )


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
    static_argnames=("config", "num_tokens", "return_block_tables", "defer_rest", "first_chunk_multi_block"),
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
    defer_rest: bool = False,
    first_chunk_multi_block: bool = False,
) -> tuple[AllocatorState, StepOutput]:
    """Allocate blocks for one scheduler step of a batch of requests, in row order (see the module docstring).

    `state` is donated. Rows with a negative slot are padding.

    Args:
      slots: [R] request slot of each row (`KVCacheManager` maps request ids to slots).
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
        addresses from call to call, so XLA re-records only the few nodes that read the per-step inputs
        (``benchmarks/RESULTS.md`` has the figures). Its values are not read.
      defer_rest: serve only what the vectorised path serves in its first chunk (a decode step's rows, in the
        common case) and mark the other rows with work `StepOutput.deferred` instead of serving them (a new
        request, a row that needs several blocks or frees an uncached one, a row that does not fit, rows past
        the first `CHUNK_ROWS` with work (all rows with `first_chunk_multi_block`), every row when the pool is due
        for maintenance); prefix-map inserts get `DEFERRED_STEP_INSERT_ROUNDS` rounds. The step then has no loop
        or branch that depends on device values: on a GPU the call returns without waiting for the device. A
        scheduler sends the deferred rows again in a step without it.
      first_chunk_multi_block: the first chunk serves what the loop's chunks serve: rows that take or cache
        several blocks (prefill chunks) and new requests that surely miss the prefix cache. With `defer_rest`,
        a prefill step's rows are then served without a host sync unless one may hit the prefix cache (it and
        the rows after it are deferred).

    Returns:
      (new state, `StepOutput`).
    """
    check_config(config)
    if num_tokens is not None:
        check_int("num_tokens", num_tokens)
    check_bool("return_block_tables", return_block_tables)
    check_bool("defer_rest", defer_rest)
    check_bool("first_chunk_multi_block", first_chunk_multi_block)
    rows = StepRows.from_arguments(
        slots, num_computed_tokens, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit
    )
    state, results, deferred = _allocate_rows(
        config, state, rows, defer_rest=defer_rest, first_chunk_multi_block=first_chunk_multi_block
    )
    out = _outputs(
        config,
        state,
        rows,
        results,
        deferred,
        num_tokens=config.max_num_batched_tokens if num_tokens is None else num_tokens,
        block_tables=return_block_tables,
    )
    if previous_output is not None:
        _check_reusable(previous_output, out)
    return state, out


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def free(config: AllocatorConfig, state: AllocatorState, slots: Int[Array, "R"]) -> AllocatorState:
    """Free every block of each request (finished or preempted), in row order; each group frees its blocks
    tail first. The slots keep their tokens and hashes (a preempted request is resumed as a new request). A slot
    out of range, or named by an earlier row, frees nothing.

    One `pool.free_blocks` over all rows, one call per (row, group) as vLLM frees them one request at a time: a
    block that several requests hold (a prefix hit) drops one reference per request and is queued by its last
    one. No loop over the rows: on a GPU each trip would launch its kernels and sync with the host."""
    check_config(config)
    slots = jnp.asarray(slots, jnp.int32)
    num_rows = slots.shape[0]
    num_groups, width = config.num_groups, config.max_blocks_per_row
    req = state.requests
    row = jnp.arange(num_rows)
    earlier = jnp.any((slots[None, :] == slots[:, None]) & (row[None, :] < row[:, None]), axis=1)
    slot_ok = (slots >= 0) & (slots < config.max_num_seqs) & ~earlier
    slot = jnp.clip(slots, 0, config.max_num_seqs - 1)
    reverse = jnp.moveaxis(req.tables[:, slot, ::-1], 0, 1)  # [R, G, P_max]: each group's tail block first
    position = width - 1 - jnp.arange(width, dtype=jnp.int32)
    lengths = RequestRows(req.rows[slot]).num_table_blocks.T  # [R, G]
    mask = slot_ok[:, None, None] & (position < lengths[..., None]) & (reverse != NULL_BLOCK_ID)
    calls = jnp.arange(num_rows * num_groups, dtype=jnp.int32).reshape(num_rows, num_groups)
    pool = pool_ops.free_blocks(
        state.pool,
        reverse.reshape(-1),
        mask.reshape(-1),
        jnp.broadcast_to(calls[..., None], reverse.shape).reshape(-1),
        num_calls=num_rows * num_groups,
        unique=False,
    )
    drop = jnp.where(slot_ok, slot, config.max_num_seqs)
    cleared = req.rows[slot].at[:, RUNNING].set(0).at[:, ROW_GROUP_COLUMNS:].set(0)
    req = dataclasses.replace(
        req,
        tables=req.tables.at[:, drop, :].set(NULL_BLOCK_ID, mode="drop"),
        rows=req.rows.at[drop].set(cleared, mode="drop"),
    )
    return dataclasses.replace(state, pool=pool, requests=req)


@partial(jax.jit, static_argnames=("config",))
def get_computed_blocks(config: AllocatorConfig, state: AllocatorState, slots: Int[Array, "R"]):
    """Prefix hits of requests as they stand (read only; `allocate_slots` searches again when it runs).

    Returns (hit tokens [R], per group [R, P_g] hit block lists with null blocks). Hits are capped at
    ``num_tokens - 1`` so that the last token is computed; 0 when caching is off.
    """
    check_config(config)
    slots = jnp.clip(jnp.asarray(slots, jnp.int32), 0, config.max_num_seqs - 1)
    if not config.enable_caching:
        nulls = jnp.full((slots.shape[0], config.max_blocks_per_row), NULL_BLOCK_ID, jnp.int32)
        return jnp.zeros(slots.shape, jnp.int32), tuple(nulls[:, :p] for p in config.blocks_per_row)

    def one(slot):
        max_length = RequestRows(state.requests.rows, slot).num_tokens - 1
        length, lists, _ = compute_hits(config, state.pool, state.requests, slot, max_length)
        return length, lists

    lengths, lists = jax.vmap(one)(slots)
    return lengths, tuple(lists[:, g, :p] for g, p in enumerate(config.blocks_per_row))


@partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def reset_prefix_cache(config: AllocatorConfig, state: AllocatorState):
    """Forget every cached hash, only when no block is in use. Returns (state, whether it was reset)."""
    check_config(config)
    pool, ok = pool_ops.reset_prefix_cache(state.pool)
    return dataclasses.replace(state, pool=pool), ok


def usage(state: AllocatorState) -> Array:
    """Fraction of usable blocks in use: ``1 - num_free / (num_blocks - 1)``."""
    usable = state.pool.info.shape[0] - 1
    return 1.0 - state.pool.num_free / max(usable, 1)
