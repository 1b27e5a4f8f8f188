"""`KVCacheManager`: a thin Python object around the jitted allocator, for schedulers written in Python.

It maps request ids to slots, keeps each request's computed-token count, pads every step's batch to
``max_num_seqs`` rows (one compiled shape) and each batch of added or freed requests to one of a few sizes
(`request_batches`), checks arguments, and returns Python lists where vLLM does. All the work happens in
the jitted functions of `step` and `requests` (the step compiled with `compile_allocate_slots`, below, one task
per memory-bound operation on a CPU); the state stays on the device.

Differences from vLLM's `KVCacheManager` beyond those of `step`: `allocate_slots` returns every block id of the
request per group (vLLM returns the newly allocated blocks); a request must be added (`add_request`) before it
is allocated; prefix hits are found by `allocate_slots` itself, `get_computed_blocks` only previews them.
"""

import dataclasses
import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..integers import check_bool, check_int
from . import pool as pool_ops
from . import requests as request_ops
from . import step as step_ops
from .columns import STAT_HITS, STAT_QUERIES, STAT_REQUESTS, RequestRows
from .common_prefix import num_common_prefix_blocks
from .config import AllocatorConfig, check_config
from .hashing import NO_ADAPTER
from .request_batches import RequestBatches, check_new_requests, check_request_id, per_request, token_id_array
from .state import AllocatorState, PrefixCacheStats, init_state
from .xla_cpu import compile_single_task

__all__ = ["KVCacheManager", "compile_allocate_slots"]


class KVCacheManager:
    """vLLM-style allocator API over `AllocatorState` (see the module docstring).

    Example:
      >>> manager = KVCacheManager(config)
      >>> manager.add_request("a", prompt_token_ids)
      >>> manager.allocate_slots("a", len(prompt_token_ids))      # [[block ids of group 0], ...] or None
      >>> manager.append_token_ids("a", [sampled_token])
      >>> manager.allocate_slots("a", 1)
      >>> manager.free("a")
    """

    def __init__(self, config: AllocatorConfig, *, reuse_output_buffers: bool = False):
        """``reuse_output_buffers``: each `schedule` writes its `StepOutput` into the previous one's buffers
        (`step.allocate_slots`' ``previous_output``), which is faster on a GPU; a `StepOutput` is then valid only
        until the next `schedule` (its arrays are deleted)."""
        self.config = check_config(config)
        self.state = init_state(config)
        self.reuse_output_buffers = check_bool("reuse_output_buffers", reuse_output_buffers)
        self._last_output: step_ops.StepOutput | None = None
        self._compiled_steps: dict[bool, jax.stages.Compiled] = {}  # by whether a previous output is reused
        self._batches = RequestBatches(config)  # add's and free's device calls
        self._slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._num_computed: dict[Hashable, int] = {}
        self._unrecorded: list[Hashable] = []  # the rows of a schedule(wait=False) until record_step

    # ------------------------------------------------------------------------------------------- requests

    def _slot(self, request_id) -> int:
        check_request_id(request_id)
        if request_id not in self._slot_of:
            raise ValueError(f"request_id={request_id!r} is not a known request (add_request it first)")
        return self._slot_of[request_id]

    def add_request(
        self, request_id: Hashable, token_ids: Sequence[int], *, cache_salt=None, adapter_id=NO_ADAPTER
    ):
        """Register a request and its prompt; its full blocks are hashed on the device. Returns its slot.

        Checked (on the host, always), before anything changes, so that a rejected call leaves the manager as it
        was: `request_id` hashable and new; `token_ids` a flat, non-empty sequence of integer ids (no floats or
        bools) in ``[0, 2**31)`` and at most ``max_model_len`` long; `adapter_id` an int >= 0; `cache_salt` None,
        str or bytes; a free request slot. Raises `ValueError` (`TypeError` for an unhashable id) naming the
        argument."""
        return self.add_requests([request_id], [token_ids], cache_salts=[cache_salt], adapter_ids=[adapter_id])[0]

    def add_requests(
        self,
        request_ids: Sequence[Hashable],
        token_ids: Sequence[Sequence[int]],
        *,
        cache_salts: Sequence | None = None,
        adapter_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """`add_request` for several requests in one device call (a scheduler admits a batch at once: one call
        costs about what one request does). Every request is checked, as `add_request` checks it, before anything
        changes; ids must also differ from each other. Returns their slots."""
        new = check_new_requests(request_ids, token_ids, cache_salts=cache_salts, adapter_ids=adapter_ids,
                                 added=self._slot_of, max_model_len=self.config.max_model_len)  # fmt: skip
        if len(request_ids) > len(self._free_slots):
            raise ValueError(f"all max_num_seqs={self.config.max_num_seqs} request slots are in use"
                             if len(request_ids) == 1 else f"{len(request_ids)} requests, {len(self._free_slots)} "
                             f"of max_num_seqs={self.config.max_num_seqs} request slots free")  # fmt: skip
        slots = [self._free_slots.pop() for _ in request_ids]
        self.state = self._batches.add(self.state, slots, new)
        for request_id, slot in zip(request_ids, slots, strict=True):
            self._slot_of[request_id] = slot
            self._num_computed[request_id] = 0
        return slots

    def compile(self) -> None:
        """Compile `add_requests`' and `free_requests`' (and so `add_request`'s, `free`'s and `preempt`'s) device
        operations ahead of time for this configuration and state, for each batch size: a server calls it before
        serving, so that no request waits for a compile."""
        self._batches.compile(self.state)

    def append_token_ids(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens (e.g. the one sampled this step) to a request.

        Checked first, on the host (a rejected call changes nothing): a known `request_id`; `token_ids` a flat
        sequence of integer ids in ``[0, 2**31)`` that keeps the request within ``max_model_len``."""
        slot = self._slot(request_id)
        tokens = token_id_array("token_ids", token_ids).reshape(1, -1)
        length = self.num_tokens(request_id)
        if length + tokens.shape[1] > self.config.max_model_len:
            raise ValueError(
                f"request_id={request_id!r}: {length} + {tokens.shape[1]} tokens exceed max_model_len="
                f"{self.config.max_model_len}"
            )
        self.state = request_ops.append_token_ids(
            self.config,
            self.state,
            jnp.array([slot]),
            jnp.asarray(tokens, jnp.int32),
            jnp.array([tokens.shape[1]]),
        )

    def append_row_token_ids(
        self, request_ids: Sequence[Hashable | None], token_ids: jax.Array, *, mask: jax.Array | None = None
    ) -> None:
        """Append ``token_ids[r]`` to ``request_ids[r]`` for every row whose id is not None (and, with `mask`, a
        device [R] bool array, whose mask is set), on the device: the tokens a step sampled go back to the
        allocator without a host round trip.

        Checked on the host first (a rejected call changes nothing): known, distinct ids; `token_ids` an int
        array of one token per row, at least ``len(request_ids)`` rows (a numpy array's ids in
        ``[0, 2**31)``); `mask` a bool array of as many rows. Not checked, as that would read the device: a
        JAX array's ids, and a row that would pass ``max_model_len``, which is ignored (the caller stops a
        request at that length)."""
        _check_id_sequence("request_ids", request_ids)
        if not isinstance(token_ids, (jax.Array, np.ndarray)) or token_ids.ndim != 1:
            raise ValueError(f"token_ids must be a [R] jax or numpy array, got {type(token_ids).__name__}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer) or token_ids.shape[0] < len(request_ids):
            raise ValueError(
                f"token_ids ({token_ids.dtype}, {token_ids.shape[0]} rows) must be integers, one per request "
                f"({len(request_ids)})"
            )
        if isinstance(token_ids, np.ndarray):
            token_id_array("token_ids", token_ids)
        is_mask = isinstance(mask, (jax.Array, np.ndarray)) and mask.dtype == np.bool_
        if mask is not None and not (is_mask and mask.shape == token_ids.shape):
            raise ValueError(f"mask={mask!r:.60} must be None or a bool array of shape {token_ids.shape}")
        named = [request_id for request_id in request_ids if request_id is not None]
        if len(set(named)) != len(named):
            raise ValueError(f"request_ids={list(request_ids)!r} must be distinct")
        slots = np.full(token_ids.shape[0], -1, np.int32)
        for row, request_id in enumerate(request_ids):
            if request_id is None:
                continue
            slots[row] = self._slot(request_id)
        self.state = request_ops.append_token_ids(
            self.config,
            self.state,
            jnp.asarray(slots),
            jnp.asarray(token_ids, jnp.int32)[:, None],
            jnp.asarray(slots >= 0, jnp.int32) * (1 if mask is None else jnp.asarray(mask, jnp.int32)),
        )

    def slot(self, request_id: Hashable) -> int:
        """The request's row in the state's request table (for callers that run the jitted functions)."""
        return self._slot(request_id)

    def num_tokens(self, request_id: Hashable) -> int:
        return int(RequestRows(self.state.requests.rows, self._slot(request_id)).num_tokens)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        self._slot(request_id)
        return self._num_computed[request_id]

    # -------------------------------------------------------------------------------------------- the step

    def schedule(
        self,
        new_tokens: Sequence[tuple[Hashable, int]],
        *,
        num_lookahead_tokens: Sequence[int] | None = None,
        full_sequence_must_fit: Sequence[bool] | None = None,
        wait: bool = True,
    ) -> step_ops.StepOutput:
        """One `allocate_slots` call for a batch of ``(request_id, num_new_tokens)``, in row order (vLLM's: running
        requests, then new ones). Rows are padded to ``max_num_seqs``; T is ``max_num_batched_tokens``.

        With ``wait=False`` nothing is read back: the step's output stays on the device for the caller's next
        computations, and the caller reports the rows' `success` and `seq_lens` with `record_step` (as host
        arrays, read together with its own results) before the next `schedule`."""
        config = self.config
        if self._unrecorded:
            raise RuntimeError(f"record_step(...) for the rows {self._unrecorded!r} of the last schedule(wait=False)")
        if not isinstance(new_tokens, Sequence) or not all(
            isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2 for pair in new_tokens
        ):
            raise ValueError(f"new_tokens={new_tokens!r} must be a sequence of (request_id, num_new_tokens) pairs")
        if len(new_tokens) > config.max_num_seqs:
            raise ValueError(f"{len(new_tokens)} requests exceed max_num_seqs={config.max_num_seqs}")
        ids = [request_id for request_id, _ in new_tokens]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids!r} must be distinct")
        counts = []
        for request_id, count in new_tokens:
            self._slot(request_id)
            try:
                counts.append(check_int("num_new_tokens", count))
            except ValueError as error:
                raise ValueError(f"{error} (request {request_id!r})") from None
        if sum(counts) > config.max_num_batched_tokens:
            raise ValueError(
                f"num_new_tokens={counts} sum to {sum(counts)}, more than max_num_batched_tokens="
                f"{config.max_num_batched_tokens}"
            )
        lookahead = per_request(
            "num_lookahead_tokens", num_lookahead_tokens, 0, len(ids),
            lambda name, x: check_int(name, x, minimum=0, maximum=config.max_num_lookahead_tokens),
        )  # fmt: skip
        must_fit = per_request("full_sequence_must_fit", full_sequence_must_fit, False, len(ids), check_bool)

        pad = config.max_num_seqs - len(ids)
        slots = np.array([self._slot_of[i] for i in ids] + [-1] * pad, np.int32)
        computed = np.array([self._num_computed[i] for i in ids] + [0] * pad, np.int32)
        args = (
            jnp.asarray(slots),
            jnp.asarray(computed),
            jnp.asarray(np.array(counts + [0] * pad, np.int32)),
            jnp.asarray(np.array(lookahead + [0] * pad, np.int32)),
            jnp.asarray(np.array(must_fit + [False] * pad)),
        )
        reused = {} if self._last_output is None else {"previous_output": self._last_output}
        if bool(reused) not in self._compiled_steps:
            self._compiled_steps[bool(reused)] = compile_allocate_slots(config, self.state, *args, **reused)
        output_state, out = self._compiled_steps[bool(reused)](self.state, *args, **reused)
        self.state = output_state
        if self.reuse_output_buffers:
            self._last_output = out
        self._unrecorded = ids
        if check_bool("wait", wait):
            self.record_step(ids, np.asarray(out.success), np.asarray(out.seq_lens))
        return out

    def record_step(self, request_ids: Sequence[Hashable], success: np.ndarray, seq_lens: np.ndarray) -> None:
        """After ``schedule(..., wait=False)``: its rows' `success` and `seq_lens`, read back by the caller
        (bool and integer arrays of a row per request at least, lengths in ``[0, max_model_len]``); checked
        before anything changes."""
        _check_id_sequence("request_ids", request_ids)
        if list(request_ids) != list(self._unrecorded):
            raise ValueError(f"request_ids={list(request_ids)!r} must be the last schedule's {self._unrecorded!r}")
        rows = len(request_ids)
        success, seq_lens = np.asarray(success), np.asarray(seq_lens)
        if success.dtype != np.bool_ or success.ndim != 1 or success.shape[0] < rows:
            raise ValueError(f"success={success!r:.80} must be a bool array of at least {rows} rows")
        if not np.issubdtype(seq_lens.dtype, np.integer) or seq_lens.ndim != 1 or seq_lens.shape[0] < rows:
            raise ValueError(f"seq_lens={seq_lens!r:.80} must be an integer array of at least {rows} rows")
        lengths = seq_lens[:rows][success[:rows]]
        if lengths.size and (lengths.min() < 0 or lengths.max() > self.config.max_model_len):
            limit = self.config.max_model_len
            raise ValueError(f"seq_lens={seq_lens[:rows].tolist()} must lie in [0, max_model_len={limit}]")
        for row, request_id in enumerate(request_ids):
            if success[row]:
                self._num_computed[request_id] = int(seq_lens[row])
        self._unrecorded = []

    def allocate_slots(
        self,
        request_id: Hashable,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> list[list[int]] | None:
        """Allocate for one request (vLLM's per-request call). Returns its block ids per group, or None if the
        pool has no room (the state is then unchanged)."""
        out = self.schedule(
            [(request_id, num_new_tokens)],
            num_lookahead_tokens=[num_lookahead_tokens],
            full_sequence_must_fit=[full_sequence_must_fit],
        )
        return self.get_block_ids(request_id) if bool(out.success[0]) else None

    def get_computed_blocks(self, request_id: Hashable) -> tuple[list[list[int]], int]:
        """Preview the prefix hit of a request: (hit block ids per group, null blocks included; hit tokens)."""
        slot = self._slot(request_id)
        length, lists = step_ops.get_computed_blocks(self.config, self.state, jnp.array([slot]))
        length = int(length[0])
        return [table[0, : length // s].tolist() for table, s in zip(lists, self.config.block_sizes)], length

    def free(self, request_id: Hashable) -> None:
        """Free a finished request's blocks (each group tail first) and release its slot."""
        self.free_requests([request_id])

    def free_requests(self, request_ids: Sequence[Hashable]) -> None:
        """`free` several requests in one device call (in order); every id is checked first."""
        _check_id_sequence("request_ids", request_ids)
        slots = [self._slot(request_id) for request_id in request_ids]
        if len(set(slots)) != len(slots):
            raise ValueError(f"request_ids={list(request_ids)!r} names a request twice")
        self._release_blocks(slots)
        for request_id, slot in zip(request_ids, slots, strict=True):
            self._free_slots.append(slot)
            del self._slot_of[request_id], self._num_computed[request_id]

    def preempt(self, request_id: Hashable) -> None:
        """Free a request's blocks but keep it (and its tokens): its next `allocate_slots` starts over, with
        prefix hits on whatever of its blocks is still cached."""
        self._release_blocks([self._slot(request_id)])
        self._num_computed[request_id] = 0

    def _release_blocks(self, slots: list[int]) -> None:
        self.state = self._batches.free(self.state, slots)

    # --------------------------------------------------------------------------------------- inspection

    def get_block_ids(self, request_id: Hashable) -> list[list[int]]:
        """The request's block list per group, null blocks (`NULL_BLOCK_ID`) included."""
        slot = self._slot(request_id)
        requests = self.state.requests
        lengths = np.asarray(requests.num_table_blocks[:, slot])
        tables = np.asarray(requests.tables[:, slot])
        return [tables[g, : lengths[g]].tolist() for g in range(self.config.num_groups)]

    def get_num_common_prefix_blocks(self) -> list[int]:
        """Per group, the leading blocks every running request holds (`common_prefix.num_common_prefix_blocks`)."""
        return np.asarray(num_common_prefix_blocks(self.state)).tolist()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        self.state, ok = step_ops.reset_prefix_cache(self.config, self.state)
        return bool(ok)

    @property
    def usage(self) -> float:
        return float(step_ops.usage(self.state))

    @property
    def num_free_blocks(self) -> int:
        return int(self.state.pool.num_free)

    def free_block_queue(self) -> list[int]:
        """Free block ids from the head (next to be taken) to the tail."""
        return pool_ops.free_queue_order(self.state.pool)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call (then reset), as ints, like vLLM's ``make_prefix_cache_stats``."""
        stats = self.state.stats
        snapshot = PrefixCacheStats(int(stats.requests), int(stats.queries), int(stats.hits))
        pool = self.state.pool
        counters = pool.counters.at[STAT_REQUESTS].set(0).at[STAT_QUERIES].set(0).at[STAT_HITS].set(0)
        self.state = dataclasses.replace(self.state, pool=dataclasses.replace(pool, counters=counters))
        return snapshot

    def __repr__(self) -> str:
        return (
            f"KVCacheManager({len(self._slot_of)} requests, {self.num_free_blocks}/{self.config.num_blocks - 1} "
            f"blocks free, groups={self.config.block_sizes})"
        )


def _check_id_sequence(name: str, request_ids) -> None:
    """`ValueError` naming `name` unless `request_ids` is a sequence (a list or tuple, not a string)."""
    if not isinstance(request_ids, (list, tuple)):
        raise ValueError(f"{name}={request_ids!r:.80} must be a list or tuple of request ids")


def _platform(state: AllocatorState) -> str:
    """Platform of the state's arrays (of the default backend for abstract ones without a sharding)."""
    leaf = state.pool.info
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return jax.default_backend()
    return next(iter(sharding.device_set)).platform


@functools.cache
def _single_task_step():
    """`step.allocate_slots` under a jit of its own: JAX caches a lowering's executable, and `allocate_slots` may
    have compiled the same lowering without pinning; every executable cached here was compiled pinned."""

    @functools.wraps(step_ops.allocate_slots.__wrapped__)  # its signature, for the static and donated names
    def pinned_allocate_slots(*args, **kwargs):
        return step_ops.allocate_slots.__wrapped__(*args, **kwargs)

    return jax.jit(
        pinned_allocate_slots,
        static_argnames=("config", "num_tokens", "return_block_tables"),
        donate_argnames=("state", "previous_output"),
        keep_unused=True,
    )


def compile_allocate_slots(
    config: AllocatorConfig,
    state: AllocatorState,
    *args,
    num_tokens: int | None = None,
    return_block_tables: bool = True,
    previous_output=None,
) -> jax.stages.Compiled:
    """`step.allocate_slots` compiled ahead of time for these arguments (arrays or `jax.ShapeDtypeStruct`), with one
    task per memory-bound operation on a CPU (`compile_single_task`). A second call for the same config, shapes and
    keywords returns the executable compiled by the first.

    Call the result with the arguments of `allocate_slots` less `config` and the static keywords (`num_tokens`,
    `return_block_tables`): ``step(state, slots, num_computed_tokens, num_new_tokens[, num_lookahead_tokens,
    full_sequence_must_fit][, previous_output=out])``, each with the shape and dtype it was compiled for (and
    `previous_output` given if and only if it was given here). `state` and `previous_output` are donated.

      >>> step = compile_allocate_slots(config, state, slots, computed, ones, num_tokens=256)
      >>> state, out = step(state, slots, computed, ones)
    """
    reused = {} if previous_output is None else {"previous_output": previous_output}
    lowered = _single_task_step().lower(
        config, state, *args, num_tokens=num_tokens, return_block_tables=return_block_tables, **reused
    )
    return compile_single_task(lowered, platform=_platform(state))
