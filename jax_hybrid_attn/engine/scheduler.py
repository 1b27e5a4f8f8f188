"""The engine's scheduling on the host: which requests run in the next step with how many tokens, what a step read
back means for each request, and which request is preempted when one gets no blocks.

The `Scheduler` holds the requests (waiting, then admitted in arrival order) and nothing of the device: it asks
for the allocator's request operations (admit, free, preempt) through the engine's `on_device` callable, which
runs them in order with the steps on the device worker. Its three phases, as nano-vllm names them:

  * `schedule`: admit waiting requests while request slots are free, then give each admitted request the tokens
    it still needs (its prompt in chunks, or one decode token) within the token budget, assuming the steps in
    flight go as planned and a new request's prompt hits the prefix cache where `CachedPrefixes` expects;
  * `postprocess`: a step read back: computed counts, sampled tokens, stops and finished requests;
  * `preempt`: each running request that got no blocks preempts the newest running request.

Shape letters: R rows (request slots).
"""

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence

from ..allocator import KVCacheManager
from ..allocator.config import FULL
from .config import EngineConfig
from .device_step import StepResult
from .prefix_estimate import CachedPrefixes
from .requests import FinishReason, InFlightWork, Request, RequestOutput
from .sampling import SamplingParams

__all__ = ["Scheduler", "StepOutcome"]

SEED_MODULUS = 2**32
"""Seeds are uint32 on the device."""


@dataclasses.dataclass
class StepOutcome:
    """What one step read back did, for the engine's counters and its next step.

    Attributes:
      finished: the requests that finished in it.
      failed: running requests that got no blocks (`Scheduler.preempt` preempts for them).
      deferred_rows: rows the allocator deferred (the next step serves every row).
      prompt_tokens, cached_prompt_tokens: prompt tokens of requests whose prefill began, and of them prefix hits.
      decode_tokens: tokens sampled by decode rows.
    """

    finished: list[RequestOutput] = dataclasses.field(default_factory=list)
    failed: list[Request] = dataclasses.field(default_factory=list)
    deferred_rows: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    """First come, first served with chunked prefill and preemption of the newest request.

    Args:
      config: the engine's `EngineConfig` (its request slots, token budget and default seed).
      max_model_len: the engine's resolved ``max_model_len``.
      manager: the allocator (its request operations are sent through `on_device`, never called here).
      on_device: ``on_device(fn, *args)`` runs ``fn(*args)`` after every device call made before it.
      eos_token_ids: the tokens that end a request (unless its `SamplingParams.ignore_eos`).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_model_len: int,
        manager: KVCacheManager,
        on_device: Callable,
        eos_token_ids: frozenset[int],
    ):
        self.config, self.max_model_len = config, max_model_len
        self._manager, self._on_device, self._eos_token_ids = manager, on_device, eos_token_ids
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # hold a request slot, in arrival order (preempted ones included)
        self._ids: set[Hashable] = set()
        self._next_index = 0
        allocator = manager.config
        full = [size for size, kind in zip(allocator.block_sizes, allocator.kinds, strict=True) if kind == FULL]
        self.cached_prefixes = CachedPrefixes(
            block_size=allocator.hash_block_size, alignment=allocator.alignment,
            capacity=allocator.num_blocks * allocator.block_sizes[0] // allocator.hash_block_size,
            first_lookup_blocks=full[0] // allocator.hash_block_size if full else 0,
        ) if allocator.enable_caching else None  # fmt: skip

    # ------------------------------------------------------------------------------------------- requests

    def add(self, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, request_id=None) -> Hashable:
        """Queue a request of a checked prompt; returns its id (when None: its arrival index, or the first integer
        after it that no request holds, where a caller gave that one). Raises `ValueError` for an id the scheduler
        holds."""
        index = self._next_index
        if request_id is None:
            request_id = index
            while request_id in self._ids:
                request_id += 1
        elif request_id in self._ids:
            raise ValueError(f"{request_id=} is already in the engine")
        seed = sampling.seed if sampling.seed is not None else (self.config.seed + index) % SEED_MODULUS
        self.waiting.append(Request(request_id, index, list(prompt_token_ids), sampling, seed))
        self._ids.add(request_id)
        self._next_index += 1
        return request_id

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """Stop a request now (finish reason "abort"): a waiting one leaves the queue, a running one frees its
        blocks after the steps already sent. Its output so far, or None for an id the scheduler does not hold."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._ids.discard(request_id)
                request.finish_reason = FinishReason.ABORT
                return RequestOutput.of(request)
        for request in self.running:
            if request.request_id == request_id:
                request.finish_reason = FinishReason.ABORT
                return self._release(request)
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------------------------------- the phases

    def schedule(self) -> list[tuple[Request, InFlightWork]]:
        """The next step's rows: (request, its work: tokens to compute and whether it then samples), ordered as
        vLLM's scheduler orders them: the requests with computed tokens read back first (decodes, prompts part
        way), then the ones starting (newly admitted or preempted), each in arrival order; so a preempted request
        that cannot get its blocks back never takes the budget that the requests holding them need to finish.
        The steps in flight are assumed to go as planned; a request whose last token is in flight is left out."""
        budget = self.config.max_num_batched_tokens
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            request.admitted = True
            self.running.append(request)
            admitted.append(request)
        if admitted:  # in one device call
            self._on_device(self._manager.add_requests, [r.request_id for r in admitted],
                            [r.all_token_ids for r in admitted])  # fmt: skip
        rows = []
        for request in sorted(self.running, key=lambda r: r.num_computed_tokens == 0):  # a stable sort
            outputs = request.expected_num_outputs
            known = len(request.prompt_token_ids) + outputs
            if outputs > len(request.output_token_ids) and (
                outputs >= request.sampling.max_tokens or known >= self.max_model_len
            ):
                continue
            computed = request.expected_num_computed_tokens
            hits = 0
            if computed == 0 and self.cached_prefixes is not None:  # a new (or preempted) request
                hits = self.cached_prefixes.hit_tokens(request.all_token_ids)
            need = min(known - computed - hits, budget)
            if need > 0:
                rows.append((request, InFlightWork(need, samples=computed + hits + need == known, expected_hits=hits)))
                budget -= need
        return rows

    def lookups_may_hit(self, rows: list[tuple[Request, InFlightWork]]) -> bool:
        """Whether a new (or preempted) request of `rows`, a step's rows before they are sent, may hit the prefix
        cache as the allocator's vectorised path judges it: the cache may hold its first blocks
        (`CachedPrefixes.may_hit`), or an earlier row of the step starts with the same hash block (and may cache it
        first). Such a row would stop a deferring step's first chunk (`allocate_slots`' ``defer_rest``)."""
        cached = self.cached_prefixes
        new = [request.expected_num_computed_tokens == 0 for request, _ in rows]
        if cached is None or not any(new):  # a decode step: nothing more to look at
            return False
        first_blocks = set()
        for (request, _), is_new in zip(rows, new, strict=True):
            tokens = request.all_token_ids if is_new else request.prompt_token_ids  # no copy for running rows
            first = tuple(tokens[: cached.block_size])
            if is_new and (cached.may_hit(tokens) or (first in first_blocks and len(tokens) - 1 >= cached.alignment)):
                return True
            if len(first) == cached.block_size:
                first_blocks.add(first)
        return False

    def postprocess(
        self,
        rows: list[tuple[Request, int] | None],
        result: StepResult,
        *,
        now: float,
        on_token: Callable[[Hashable, int], None] | None = None,
    ) -> StepOutcome:
        """A step read back: `rows` are its requests, each with its preemption count when the step was sent;
        `result` the step's `StepResult` (host arrays). Each sampled token is appended (``on_token(request_id,
        token)``), and a request that reaches a stop token or its length finishes and frees its blocks."""
        outcome = StepOutcome()
        for i, row in enumerate(rows):
            if row is None:  # not in this step (a step of a call of several, past the row's last)
                continue
            request, preemptions = row
            request.in_flight.popleft()
            if request.finished:  # it stopped in an earlier step: this one computed past its stop token
                continue
            current = preemptions == request.num_preemptions  # else its blocks were freed after it was sent
            if current and result.success[i]:
                if request.num_computed_tokens == 0:
                    outcome.prompt_tokens += len(request.prompt_token_ids)
                request.num_cached_tokens += int(result.num_hits[i])
                outcome.cached_prompt_tokens += int(result.num_hits[i])
                request.num_computed_tokens = int(result.seq_lens[i])
            elif current and result.deferred[i]:
                outcome.deferred_rows += 1
            elif current and request.num_computed_tokens:
                outcome.failed.append(request)
            if result.sampled[i] and not request.output_token_ids and self.cached_prefixes is not None:
                self.cached_prefixes.insert(request.prompt_token_ids)  # its prompt is in the cache now
            if result.sampled[i]:
                outcome.decode_tokens += int(result.num_scheduled[i] == 1 and bool(request.output_token_ids))
                token = int(result.tokens[i])
                request.output_token_ids.append(token)
                request.token_times.append(now)
                if on_token is not None:
                    on_token(request.request_id, token)
                reason = self._finish_reason(request, token)
                if reason is not None:
                    request.finish_reason = reason
                    outcome.finished.append(self._release(request, free=False))
        if outcome.finished:  # their blocks, in one device call
            self._on_device(self._manager.free_requests, [output.request_id for output in outcome.finished])
        return outcome

    def preempt(self, failed: list[Request]) -> int:
        """Each running request that got no blocks preempts the newest running request (possibly itself); returns
        the preemptions. The victim's steps in flight still sample (its blocks are freed after them), but compute
        nothing it keeps."""
        preemptions = 0
        for request in failed:
            running = [r for r in self.running if r.num_computed_tokens > 0]
            if request not in running:  # preempted already, as an earlier row's victim
                continue
            victim = max(running, key=lambda r: r.index)
            self._on_device(self._manager.preempt, victim.request_id)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            for work in victim.in_flight:
                work.num_tokens = work.expected_hits = 0
            preemptions += 1
        return preemptions

    # -------------------------------------------------------------------------------------------- helpers

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        s = request.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self._eos_token_ids):
            return FinishReason.STOP
        if len(request.output_token_ids) >= s.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, request: Request, *, free: bool = True) -> RequestOutput:
        """Take a finished request out; its blocks are freed (`free`), or the caller frees them."""
        if free:
            self._on_device(self._manager.free, request.request_id)
        self.running.remove(request)
        self._ids.discard(request.request_id)
        return RequestOutput.of(request)
