"""What each KV-cache group of each row needs this step: vLLM's per-request arithmetic, for R rows at once.

For one row (``n`` tokens computed, ``t`` new tokens, ``la`` lookahead tokens; a row whose request holds no blocks
may first get ``h`` prefix-hit tokens, and then computes from ``n + h``; ``t`` is then clipped to the tokens left),
per group ([G, R] arrays):
  * ``free_count``: blocks wholly before the window or chunk of token ``n + h`` (`group_rules.skipped_blocks`) that
    the request still holds; they are freed, highest index first, and their columns hold the null block.
  * ``new_count``: blocks to take, ``cdiv(min(n + h + t + la, L), S) - len(blocks)``, where a new request's
    ``len(blocks)`` counts its skipped and prefix-hit blocks.
  * ``cache_count``: full blocks to offer to the prefix cache, up to ``min(n + h + t, num_tokens)`` tokens (rounded
    down to the lcm of the block sizes when there are several groups), from the first block not yet offered.
  * the admission gate (``full_sequence_must_fit``, vLLM's): room for all known tokens, each group capped at its
    admission cap (`AllocatorConfig.admission_caps`), beyond the blocks the request holds.
Nothing here changes the state: the one-row and vectorised paths decide which rows fit, and `commit` carries them
out.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._compat import register_pytree_dataclass
from .columns import RequestRows
from .config import FULL, AllocatorConfig
from .group_rules import group_constants, in_window_chunk, kind_mask, per_block, skipped_blocks
from .state import AllocatorState, RequestTable
from .xla_cpu import materialize

__all__ = ["RowPlan", "RowResults", "StepRows", "gather_rows", "idle_rows", "plan_rows"]


@dataclasses.dataclass(frozen=True)
class StepRows:
    """`allocate_slots`' arguments, one entry per row ([R] each); `active` is False for padding the step adds."""

    slot: Int[Array, "R"]
    num_computed: Int[Array, "R"]
    num_new: Int[Array, "R"]
    num_lookahead: Int[Array, "R"]
    must_fit: Bool[Array, "R"]
    active: Bool[Array, "R"]

    @classmethod
    def from_arguments(cls, slots, num_computed, num_new, num_lookahead, must_fit) -> "StepRows":
        """The rows of `allocate_slots`' arguments (None: zeros, or False): `slots` an [R] integer array, the
        others [R] (or scalars for every row) of integers, bools for `must_fit` (`ValueError` naming them)."""
        columns = dict(slots=slots, num_computed_tokens=num_computed, num_new_tokens=num_new)
        columns.update(num_lookahead_tokens=num_lookahead, full_sequence_must_fit=must_fit)
        for name, x in columns.items():
            kind = jnp.bool_ if name == "full_sequence_must_fit" else jnp.integer
            if x is not None and not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, kind)):
                raise ValueError(f"{name}={x!r:.60} must be an array of {kind.__name__}s")
            if x is not None and name != "slots" and jnp.shape(x) not in ((), jnp.shape(slots)):
                raise ValueError(f"{name}.shape={jnp.shape(x)} must be () or slots.shape={jnp.shape(slots)}")
        if jnp.ndim(slots) != 1:
            raise ValueError(f"slots.shape={jnp.shape(slots)} must be [R]")
        slots = jnp.asarray(slots, jnp.int32)
        zeros = jnp.zeros(slots.shape, jnp.int32)

        def column(x, default, dtype):
            return default if x is None else jnp.broadcast_to(jnp.asarray(x, dtype), slots.shape)

        return cls(
            slot=slots,
            num_computed=column(num_computed, zeros, jnp.int32),
            num_new=column(num_new, zeros, jnp.int32),
            num_lookahead=column(num_lookahead, zeros, jnp.int32),
            must_fit=column(must_fit, jnp.zeros(slots.shape, bool), bool),
            active=jnp.ones(slots.shape, bool),
        )

    def at(self, r) -> "StepRows":
        """Row `r` alone (each field [1])."""
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1), self)

    def pack(self) -> Int[Array, "R 6"]:
        """The fields side by side as int32 (so that one gather picks rows)."""
        return jnp.stack([getattr(self, f.name).astype(jnp.int32) for f in dataclasses.fields(self)], axis=1)

    @classmethod
    def unpack(cls, packed: Int[Array, "R 6"]) -> "StepRows":
        columns = {f.name: packed[:, i] for i, f in enumerate(dataclasses.fields(cls))}
        return cls(**{**columns, "must_fit": columns["must_fit"] != 0, "active": columns["active"] != 0})


@dataclasses.dataclass(frozen=True)
class RowResults:
    """What the step did for each row ([R] each): `StepOutput`'s success, num_computed_tokens,
    num_scheduled_tokens and num_new_computed_tokens."""

    success: Bool[Array, "R"]
    computed: Int[Array, "R"]
    scheduled: Int[Array, "R"]
    hits: Int[Array, "R"]


for _cls in (StepRows, RowResults):
    register_pytree_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One step of R rows before the admission decision: [R] per row, [G, R] per (group, row).

    Attributes:
      slot: request slot of each row, clipped into range.
      stored: the slots' request rows, gathered once.
      is_new: the request holds no blocks (new or preempted).
      computed: tokens in the cache, prefix hits included; new_tokens: tokens to compute (clipped).
      valid: an active row with a slot and numbers that allow a step.
      skipped: blocks wholly out of the window or chunk; hit_blocks: blocks of the prefix hit.
      freeable: the held columns whose block is out of the window or chunk (the frees end below it).
      free_count, new_count, cache_count: blocks to free, to take, to offer to the prefix cache.
      base_len: table length before the new blocks (hits included); cache_from: first block not yet offered.
      len_after, null_after, cached_after: the request row's per-group counters after the step.
      gate_blocks: blocks for all known tokens (capped) beyond those held: the admission gate.
    """

    slot: Int[Array, "R"]
    stored: RequestRows
    is_new: Bool[Array, "R"]
    computed: Int[Array, "R"]
    new_tokens: Int[Array, "R"]
    valid: Bool[Array, "R"]
    skipped: Int[Array, "G R"]
    hit_blocks: Int[Array, "G R"]
    freeable: Int[Array, "G R"]
    free_count: Int[Array, "G R"]
    base_len: Int[Array, "G R"]
    new_count: Int[Array, "G R"]
    cache_from: Int[Array, "G R"]
    cache_count: Int[Array, "G R"]
    len_after: Int[Array, "G R"]
    null_after: Int[Array, "G R"]
    cached_after: Int[Array, "G R"]
    gate_blocks: Int[Array, "R"]

    @property
    def new_blocks(self) -> Int[Array, "R"]:
        return jnp.sum(self.new_count, axis=0)


def gather_rows(config: AllocatorConfig, requests: RequestTable, slots: Int[Array, "R"]):
    """(slot in range, clipped slot, the slots' request rows): [R], [R], `RequestRows` over [R, 5 + 3G]."""
    slot_ok = (slots >= 0) & (slots < config.max_num_seqs)
    slot = jnp.clip(slots, 0, config.max_num_seqs - 1)
    return slot_ok, slot, RequestRows(materialize(requests.rows[slot]))


def looks_up_prefix(rows: StepRows, is_new: Bool[Array, "R"]) -> Bool[Array, "R"]:
    """The rows whose request searches the prefix cache: it holds no blocks (`is_new`), starts from token 0 and has
    tokens to compute (vLLM's lookup of a waiting request)."""
    return is_new & (rows.num_computed == 0) & (rows.num_new > 0)


def _numbers_ok(config: AllocatorConfig, rows: StepRows, computed, new_tokens) -> Bool[Array, "R"]:
    """The row's numbers allow a step: tokens to compute, non-negative counts, within ``max_model_len``."""
    return (
        (new_tokens > 0)
        & (rows.num_computed >= 0)
        & (rows.num_lookahead >= 0)
        & (computed + new_tokens <= config.max_model_len)
    )


def _blocks_to_hold(config: AllocatorConfig, computed, new_tokens, num_lookahead) -> Int[Array, "G R"]:
    """Blocks the table must reach: ``cdiv(min(computed + new + lookahead, L), S)``."""
    end = jnp.minimum(computed + new_tokens + num_lookahead, config.max_model_len)
    return per_block(config, end, round_up=True)


def _full_blocks(config: AllocatorConfig, computed, new_tokens, num_tokens) -> Int[Array, "G R"]:
    """Blocks that are full of known tokens after the step (the cacheable prefix, aligned with several groups)."""
    cache_until = jnp.minimum(computed + new_tokens, num_tokens)
    if config.num_groups > 1:
        cache_until = cache_until // config.alignment * config.alignment
    return per_block(config, cache_until)


def plan_rows(
    config: AllocatorConfig,
    rows: StepRows,
    slot_ok: Bool[Array, "R"],
    slot: Int[Array, "R"],
    stored: RequestRows,
    hit_tokens: Int[Array, "R"],
    hit_first: Int[Array, "G R"],
) -> RowPlan:
    """The step of each row (see the module docstring), given its prefix hit: ``hit_tokens`` tokens whose hit lists
    start with ``hit_first`` null blocks per group (zeros for a row that looked up nothing)."""
    length = config.max_model_len
    is_new = ~stored.running
    num_tokens = stored.num_tokens
    computed = rows.num_computed + hit_tokens
    new_tokens = jnp.where(is_new, jnp.minimum(rows.num_new, num_tokens - computed), rows.num_new)
    new_tokens = in_window_chunk(config, computed, new_tokens)
    valid = rows.active & slot_ok & (rows.num_new > 0) & _numbers_ok(config, rows, computed, new_tokens)

    held, num_null, num_cached = stored.num_table_blocks, stored.num_null, stored.num_cached
    skipped = skipped_blocks(config, computed)
    hit_blocks = per_block(config, hit_tokens)
    freeable = jnp.minimum(skipped, held)
    free_count = jnp.where((stored.running & valid)[None, :], jnp.maximum(freeable - num_null, 0), 0)
    base_len = jnp.where(is_new[None, :], jnp.maximum(skipped, hit_blocks), held)
    null_after = jnp.where(is_new[None, :], jnp.maximum(skipped, hit_first), jnp.maximum(num_null, freeable))
    required = _blocks_to_hold(config, computed, new_tokens, rows.num_lookahead)
    new_count = jnp.where(valid[None, :], jnp.maximum(required - base_len, 0), 0)

    known_blocks = per_block(config, jnp.minimum(num_tokens, length), round_up=True)
    cap = group_constants(config).cap
    capped = jnp.where(kind_mask(config, FULL), known_blocks, jnp.minimum(known_blocks, cap))
    gate_blocks = jnp.sum(jnp.maximum(capped - base_len, 0), axis=0)

    cache_from = jnp.where(is_new[None, :], base_len, num_cached)
    if config.enable_caching:
        cache_until = _full_blocks(config, computed, new_tokens, num_tokens)
        cache_count = jnp.where(valid[None, :], jnp.maximum(cache_until - cache_from, 0), 0)
        cached_after = jnp.maximum(cache_from, cache_until)
    else:
        cache_count = jnp.zeros_like(cache_from)
        cached_after = cache_from
    return RowPlan(
        slot=slot,
        stored=stored,
        is_new=is_new,
        computed=computed,
        new_tokens=new_tokens,
        valid=valid,
        skipped=skipped,
        hit_blocks=hit_blocks,
        freeable=freeable,
        free_count=free_count,
        base_len=base_len,
        new_count=new_count,
        cache_from=cache_from,
        cache_count=cache_count,
        len_after=jnp.maximum(base_len, required),
        null_after=null_after,
        cached_after=cached_after,
        gate_blocks=gate_blocks,
    )


def idle_rows(config: AllocatorConfig, state: AllocatorState, rows: StepRows):
    """Rows the step skips: (idle, bad), [R] each. Idle: a running request whose step frees, takes and caches
    nothing (it succeeds and changes nothing); bad: padding, a slot named twice, or a running request's invalid
    numbers (it fails)."""
    num_rows = rows.slot.shape[0]
    slot_ok, slot, stored = gather_rows(config, state.requests, rows.slot)
    first_row = (
        jnp.full(config.max_num_seqs, num_rows, jnp.int32)
        .at[slot]
        .min(jnp.where(slot_ok, jnp.arange(num_rows, dtype=jnp.int32), num_rows))
    )
    slot_ok = slot_ok & (first_row[slot] == jnp.arange(num_rows))
    computed, new_tokens = rows.num_computed, in_window_chunk(config, rows.num_computed, rows.num_new)
    valid = slot_ok & _numbers_ok(config, rows, computed, new_tokens)
    held = stored.num_table_blocks
    required = _blocks_to_hold(config, computed, new_tokens, rows.num_lookahead)
    # Each test materialized on its own: one fusion reading every column would be split over 2 tasks
    # (`xla_cpu.materialize`).
    frees = jnp.minimum(skipped_blocks(config, computed), held) > stored.num_null
    busy = materialize(jnp.any(frees | (required > held), axis=0))
    if config.enable_caching:
        cache_until = _full_blocks(config, computed, new_tokens, stored.num_tokens)
        busy = busy | materialize(jnp.any(cache_until > stored.num_cached, axis=0))
    running = stored.running
    idle = running & valid & ~rows.must_fit & ~busy
    return idle, ~slot_ok | (running & ~valid)
