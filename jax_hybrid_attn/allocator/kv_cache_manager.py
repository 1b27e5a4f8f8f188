"""`KVCacheManager`: a thin Python object around the jitted allocator, for schedulers written in Python.

It maps request ids to slots, keeps each request's computed-token count, pads every step's batch to
``max_num_seqs`` rows (one compiled shape) and each batch of added or freed requests to one of a few sizes
(`BATCH_SIZES`), checks arguments, and returns Python lists where vLLM does. All the work happens in
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

from ..integers import INT32_MAX, check_bool, check_int
from . import pool as pool_ops
from . import requests as request_ops
from . import step as step_ops
from .columns import STAT_HITS, STAT_QUERIES, STAT_REQUESTS, RequestRows
from .common_prefix import num_common_prefix_blocks
from .config import AllocatorConfig
from .hashing import NO_ADAPTER, cache_salt_words
from .state import AllocatorState, PrefixCacheStats, init_state
from .xla_cpu import compile_single_task

__all__ = ["BATCH_SIZES", "KVCacheManager", "compile_allocate_slots"]

BATCH_SIZES = (1, 8, 64)
"""Batch sizes (with ``max_num_seqs``, and below it) that `KVCacheManager.add_requests` and `free_requests` are
compiled for; a batch is padded to the next one."""


def _check_request_id(request_id) -> None:
    try:
        hash(request_id)
    except TypeError as error:
        raise TypeError(f"request_id={request_id!r} must be hashable") from error


def _token_ids(name: str, token_ids) -> np.ndarray:
    """Token ids as a flat int64 array; `ValueError` naming `name` for non-integers (floats, bools) or values
    outside ``[0, 2**31)``."""
    if isinstance(token_ids, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in token_ids):
        raise ValueError(f"{name} must hold integer token ids, not bools")
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a sequence of int token ids: {error}") from error
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of token ids, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > INT32_MAX):
        raise ValueError(f"{name} must hold token ids in [0, {INT32_MAX}], got [{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.int64)


def _per_request(name: str, values, default, num_requests: int, check) -> list:
    """One checked value per request: `values` (a sequence of `num_requests`), or `default` for each if None."""
    if values is None:
        return [default] * num_requests
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_requests:
        raise ValueError(f"{name}={values!r} must give one value per request ({num_requests})")
    return [check(name, value) for value in values]


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
        if not isinstance(config, AllocatorConfig):
            raise ValueError(f"config must be an AllocatorConfig, got {type(config).__name__}")
        self.config = config
        self.state = init_state(config)
        self.reuse_output_buffers = bool(reuse_output_buffers)
        self._last_output: step_ops.StepOutput | None = None
        self._compiled_steps: dict[bool, jax.stages.Compiled] = {}  # by whether a previous output is reused
        self._compiled_ops: dict[tuple[str, int], jax.stages.Compiled] = {}  # `compile`: add's and free's, by batch
        self._slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._num_computed: dict[Hashable, int] = {}
        self._unrecorded: list[Hashable] = []  # the rows of a schedule(wait=False) until record_step

    # ------------------------------------------------------------------------------------------- requests

    def _slot(self, request_id) -> int:
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
        if not isinstance(request_ids, Sequence) or isinstance(request_ids, (str, bytes)):
            raise TypeError(f"request_ids={request_ids!r} must be a sequence of request ids")
        single = len(request_ids) == 1

        def name(base: str, i: int) -> str:
            return base if single else f"{base}[{i}]"

        num = len(request_ids)
        if not isinstance(token_ids, Sequence) or len(token_ids) != num:
            raise ValueError(f"token_ids must give one prompt per request ({num}), got {token_ids!r:.80}")
        salts = _per_request("cache_salts", cache_salts, None, num, lambda _name, value: value)
        adapters = _per_request("adapter_ids", adapter_ids, NO_ADAPTER, num, lambda _name, value: value)
        prompts, words, adapter_values = [], [], []
        for i, request_id in enumerate(request_ids):
            _check_request_id(request_id)
            if request_id in self._slot_of or request_id in request_ids[:i]:
                raise ValueError(f"{name('request_id', i)}={request_id!r} is already added")
            tokens = _token_ids(name("token_ids", i), token_ids[i])
            if tokens.size == 0:
                raise ValueError(f"{name('token_ids', i)}=[] must hold at least one token (a request without a "
                                 "prompt never runs)")  # fmt: skip
            if tokens.size > self.config.max_model_len:
                raise ValueError(
                    f"len({name('token_ids', i)})={tokens.size} exceeds max_model_len={self.config.max_model_len}"
                )
            adapter_values.append(check_int(name("adapter_id", i), adapters[i], minimum=0))
            words.append(cache_salt_words(salts[i]))
            prompts.append(tokens)
        if num > len(self._free_slots):
            raise ValueError(f"all max_num_seqs={self.config.max_num_seqs} request slots are in use" if single else
                             f"{num} requests, {len(self._free_slots)} of max_num_seqs={self.config.max_num_seqs} "
                             "request slots free")  # fmt: skip
        slots = [self._free_slots.pop() for _ in range(num)]
        for start in range(0, num, self._batch_sizes[-1]):
            end = start + self._batch_sizes[-1]
            self.state = self._add(self.state, slots[start:end], prompts[start:end], words[start:end],
                                   adapter_values[start:end])  # fmt: skip
        for request_id, slot in zip(request_ids, slots, strict=True):
            self._slot_of[request_id] = slot
            self._num_computed[request_id] = 0
        return slots

    @functools.cached_property
    def _batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes of the compiled `add_requests` and `free_requests` (`BATCH_SIZES`, and ``max_num_seqs``)."""
        return tuple(sorted({b for b in BATCH_SIZES if b < self.config.max_num_seqs} | {self.config.max_num_seqs}))

    def _padded(self, num: int) -> int:
        return next(b for b in self._batch_sizes if b >= num)

    def _add(self, state, slots: list[int], prompts: list[np.ndarray], salts: list[np.ndarray], adapters: list[int]):
        """One device call for up to the largest batch size of requests (rows past them: slot -1, ignored)."""
        size = self._padded(len(slots))
        rows = np.zeros((size, self.config.max_model_len), np.int32)
        for i, tokens in enumerate(prompts):
            rows[i, : tokens.size] = tokens
        pad = size - len(slots)
        args = (np.array(slots + [-1] * pad, np.int32), rows,
                np.array([t.size for t in prompts] + [0] * pad, np.int32),
                np.concatenate([np.stack(salts), np.zeros((pad, 2), np.uint32)]),
                np.array(adapters + [0] * pad, np.int32))  # fmt: skip
        compiled = self._compiled_ops.get(("add", size))
        if compiled is not None:
            return compiled(state, *args)
        return request_ops.add_requests(self.config, state, *args)

    def _free(self, state, slots: list[int]):
        """One device call for up to the largest batch size of requests' blocks."""
        size = self._padded(len(slots))
        padded = np.array(slots + [-1] * (size - len(slots)), np.int32)
        compiled = self._compiled_ops.get(("free", size))
        if compiled is not None:
            return compiled(state, padded)
        return step_ops.free(self.config, state, padded)

    def compile(self) -> None:
        """Compile `add_requests`' and `free_requests`' (and so `add_request`'s, `free`'s and `preempt`'s) device
        operations ahead of time for this configuration and state, for each batch size: a server calls it before
        serving, so that no request waits for a compile."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)

        def abstract(*shapes_and_dtypes):
            return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]

        for size in self._batch_sizes:
            rows, ints = ((size, self.config.max_model_len), np.int32), ((size,), np.int32)
            salts = ((size, 2), np.uint32)
            self._compiled_ops["add", size] = request_ops.add_requests.lower(
                self.config, state, *abstract(ints, rows, ints, salts, ints)).compile()  # fmt: skip
            self._compiled_ops["free", size] = step_ops.free.lower(self.config, state, *abstract(ints)).compile()

    def append_token_ids(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append tokens (e.g. the one sampled this step) to a request.

        Checked first, on the host (a rejected call changes nothing): a known `request_id`; `token_ids` a flat
        sequence of integer ids in ``[0, 2**31)`` that keeps the request within ``max_model_len``."""
        slot = self._slot(request_id)
        tokens = _token_ids("token_ids", token_ids).reshape(1, -1)
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
        array of one token per row, at least ``len(request_ids)`` rows. Not checked, as that would read the
        device: a row that would pass ``max_model_len`` is ignored (the caller stops a request at that length)."""
        if not isinstance(token_ids, (jax.Array, np.ndarray)) or token_ids.ndim != 1:
            raise ValueError(f"token_ids must be a [R] jax or numpy array, got {type(token_ids).__name__}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer) or token_ids.shape[0] < len(request_ids):
            raise ValueError(
                f"token_ids ({token_ids.dtype}, {token_ids.shape[0]} rows) must be integers, one per request "
                f"({len(request_ids)})"
            )
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
        lookahead = _per_request(
            "num_lookahead_tokens", num_lookahead_tokens, 0, len(ids),
            lambda name, x: check_int(name, x, minimum=0, maximum=config.max_num_lookahead_tokens),
        )  # fmt: skip
        must_fit = _per_request("full_sequence_must_fit", full_sequence_must_fit, False, len(ids), check_bool)

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
        """After ``schedule(..., wait=False)``: its rows' `success` and `seq_lens`, read back by the caller."""
        if list(request_ids) != list(self._unrecorded):
            raise ValueError(f"request_ids={list(request_ids)!r} must be the last schedule's {self._unrecorded!r}")
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
        for start in range(0, len(slots), self._batch_sizes[-1]):
            self.state = self._free(self.state, slots[start : start + self._batch_sizes[-1]])

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
