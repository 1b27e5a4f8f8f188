"""The allocator's request operations in batches, for `KVCacheManager`: prompts added and requests freed in one
device call per batch, padded to one of a few compiled sizes (`BATCH_SIZES`), and the host-side checks of the
requests the manager is given (ids, token ids, per-request values), all made before anything changes.

One device call costs about what one request does: adding hashes each prompt's full blocks in a loop whose trip
count a GPU reads back to the host, so every call waits for the device to finish what was queued before it.
"""

import dataclasses
from collections.abc import Container, Hashable, Sequence

import jax
import numpy as np

from ..integers import INT32_MAX, check_int
from . import requests as request_ops
from . import step as step_ops
from .config import AllocatorConfig
from .hashing import NO_ADAPTER, cache_salt_words
from .state import AllocatorState

__all__ = ["BATCH_SIZES", "NewRequests", "RequestBatches", "check_new_requests", "per_request", "token_id_array"]

BATCH_SIZES = (1, 8, 64)
"""Batch sizes (with ``max_num_seqs``, and below it) that the add and free calls are compiled for; a batch is
padded to the next one (rows of slot -1, which the device calls ignore)."""
PAD_SLOT = -1


def check_request_id(request_id) -> None:
    try:
        hash(request_id)
    except TypeError as error:
        raise TypeError(f"request_id={request_id!r} must be hashable") from error


def token_id_array(name: str, token_ids) -> np.ndarray:
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


def per_request(name: str, values, default, num_requests: int, check) -> list:
    """One checked value per request: `values` (a sequence of `num_requests`), or `default` for each if None."""
    if values is None:
        return [default] * num_requests
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_requests:
        raise ValueError(f"{name}={values!r} must give one value per request ({num_requests})")
    return [check(name, value) for value in values]


@dataclasses.dataclass(frozen=True)
class NewRequests:
    """Checked requests to add: each one's prompt (int64 ids), cache salt words ([2] uint32) and adapter id."""

    prompts: list[np.ndarray]
    salts: list[np.ndarray]
    adapters: list[int]


def check_new_requests(
    request_ids: Sequence[Hashable],
    token_ids: Sequence[Sequence[int]],
    *,
    cache_salts: Sequence | None,
    adapter_ids: Sequence[int] | None,
    added: Container,
    max_model_len: int,
) -> NewRequests:
    """Check requests to add (`KVCacheManager.add_request`'s rules; ids also new to `added` and to each other).
    Errors name the argument, indexed when there are several (``token_ids[2]``)."""
    if not isinstance(request_ids, Sequence) or isinstance(request_ids, (str, bytes)):
        raise TypeError(f"request_ids={request_ids!r} must be a sequence of request ids")
    num = len(request_ids)

    def name(base: str, i: int) -> str:
        return base if num == 1 else f"{base}[{i}]"

    if not isinstance(token_ids, Sequence) or len(token_ids) != num:
        raise ValueError(f"token_ids must give one prompt per request ({num}), got {token_ids!r:.80}")
    salts = per_request("cache_salts", cache_salts, None, num, lambda _name, value: value)
    adapters = per_request("adapter_ids", adapter_ids, NO_ADAPTER, num, lambda _name, value: value)
    new = NewRequests([], [], [])
    for i, request_id in enumerate(request_ids):
        check_request_id(request_id)
        if request_id in added or request_id in request_ids[:i]:
            raise ValueError(f"{name('request_id', i)}={request_id!r} is already added")
        tokens = token_id_array(name("token_ids", i), token_ids[i])
        if tokens.size == 0:
            raise ValueError(f"{name('token_ids', i)}=[] must hold at least one token (a request without a prompt "
                             "never runs)")  # fmt: skip
        if tokens.size > max_model_len:
            raise ValueError(f"len({name('token_ids', i)})={tokens.size} exceeds {max_model_len=}")
        new.adapters.append(check_int(name("adapter_id", i), adapters[i], minimum=0))
        new.salts.append(cache_salt_words(salts[i]))
        new.prompts.append(tokens)
    return new


class RequestBatches:
    """The add and free device calls of one allocator configuration, a batch of requests per call (the largest
    batch size at most; more go in several calls), compiled per batch size by `compile` or jitted."""

    def __init__(self, config: AllocatorConfig):
        self.config = config
        self.sizes = tuple(sorted({b for b in BATCH_SIZES if b < config.max_num_seqs} | {config.max_num_seqs}))
        self._compiled: dict[tuple[str, int], jax.stages.Compiled] = {}

    def compile(self, state: AllocatorState) -> None:
        """Compile both calls ahead of time for `state`'s shapes, for each batch size."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        for size in self.sizes:
            ints = jax.ShapeDtypeStruct((size,), np.int32)
            rows = jax.ShapeDtypeStruct((size, self.config.max_model_len), np.int32)
            salts = jax.ShapeDtypeStruct((size, 2), np.uint32)
            self._compiled["add", size] = request_ops.add_requests.lower(
                self.config, state, ints, rows, ints, salts, ints).compile()  # fmt: skip
            self._compiled["free", size] = step_ops.free.lower(self.config, state, ints).compile()

    def add(self, state: AllocatorState, slots: list[int], new: NewRequests) -> AllocatorState:
        """Put each new request's prompt in its slot and hash its full blocks."""
        for start in range(0, len(slots), self.sizes[-1]):
            batch = slice(start, start + self.sizes[-1])
            state = self._add(state, slots[batch], new.prompts[batch], new.salts[batch], new.adapters[batch])
        return state

    def free(self, state: AllocatorState, slots: list[int]) -> AllocatorState:
        """Free the blocks of the requests in `slots`, in order."""
        for start in range(0, len(slots), self.sizes[-1]):
            batch = slots[start : start + self.sizes[-1]]
            size = self._padded(len(batch))
            padded = np.array(batch + [PAD_SLOT] * (size - len(batch)), np.int32)
            compiled = self._compiled.get(("free", size))
            state = compiled(state, padded) if compiled is not None else step_ops.free(self.config, state, padded)
        return state

    def _padded(self, num: int) -> int:
        return next(size for size in self.sizes if size >= num)

    def _add(self, state, slots: list[int], prompts: list[np.ndarray], salts: list[np.ndarray], adapters: list[int]):
        size = self._padded(len(slots))
        pad = size - len(slots)
        rows = np.zeros((size, self.config.max_model_len), np.int32)
        for i, tokens in enumerate(prompts):
            rows[i, : tokens.size] = tokens
        args = (np.array(slots + [PAD_SLOT] * pad, np.int32), rows,
                np.array([t.size for t in prompts] + [0] * pad, np.int32),
                np.concatenate([np.stack(salts), np.zeros((pad, 2), np.uint32)]),
                np.array(adapters + [0] * pad, np.int32))  # fmt: skip
        compiled = self._compiled.get(("add", size))
        if compiled is not None:
            return compiled(state, *args)
        return request_ops.add_requests(self.config, state, *args)
