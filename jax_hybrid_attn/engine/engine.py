"""The continuous-batching engine: requests in, tokens out, on the hybrid allocator and the paged kernels.

One `Engine.step`:
  1. plan (host, `Scheduler.schedule`): the admitted requests in arrival order, then new ones while request
     slots are free, each with as many tokens as it still needs (its prompt in chunks, or one decode token)
     within the token budget;
  2. send the plan to the device (`device_step`, two jitted calls, nothing read back): the allocator finds
     prefix hits and hands out blocks in every KV-cache group; then `metadata_from_step` per group, the model's
     forward through `PagedCache` (each layer writes its K/V by slot and attends, `layer_attention`), the logits
     of each row's last token, sampling, and the sampled tokens back into the allocator (for prefix hashing);
  3. read the previous step's results back (the one read of a step) while this one runs
     (`Scheduler.postprocess`): each request that finished its prompt or decoded gets its token, stops at an end
     or stop token, `max_tokens` or `max_model_len`, and frees its blocks; a running request that got no blocks
     preempts the newest running request (`Scheduler.preempt`: its blocks are freed; it is recomputed later,
     from its prompt and outputs, with prefix hits on what is still cached).

The host plans step n+2 before it has read step n (`STEPS_IN_FLIGHT`), assuming the steps in flight go as planned;
the device computes each step from what the steps before it really did (`device_step`), so a request that got no
blocks simply retries. What the lag costs: a request that ends on a stop token computes up to two tokens more,
which are dropped.

A step lets the allocator defer the rows it cannot serve at once (a decode reaching a new chunk, a request that
does not fit, the pool due for maintenance): they compute nothing and the next step, sent without deferral, serves
them. Such a step has no loop or branch on device values, so on a GPU the host queues it without waiting for the
step before it. A step that admits a request that may hit the prefix cache (`Scheduler.lookups_may_hit`), which
the deferring step would defer with every row after it, serves every row at once instead.

With ``EngineConfig.decode_steps`` K > 1, when every planned row decodes (and none for the first time after its
prompt) and the last step read back deferred none, one device call runs K decode steps
(`device_step.decode_steps`), each request in as many as it has tokens left before its length limits (at least
one request in all K): the host plans, sends and reads the call as K steps (their results come back together),
and what a request computed past its stop token in the call is dropped as above. Requests that arrive meanwhile
wait for the call.

Everything that reads or writes the device state (the allocator's state and the caches: sending a step, adding,
freeing and preempting requests) runs in order on one worker thread. On a GPU, XLA reads each data-dependent
loop's condition back to the host before it launches what follows, so sending a step waits for the step before
it to finish; on the worker, that wait overlaps the host's planning and reading instead of adding to them.

Shape letters: T tokens of the step · R rows (request slots) · V vocabulary.
"""

import collections
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from ..allocator import KVCacheManager
from ..allocator.config import FULL
from ..allocator.request_batches import check_request_id
from ..cascade import cascade_pays
from ..integers import cdiv, check_int
from ..models.config import ModelConfig
from ..sharding import tensor_parallel_mesh
from .config import DEFAULT_MAX_MODEL_LEN, EngineConfig, EngineStats
from .device_step import NO_SLOT, StepPlan
from .kv_layout import KVCacheLayout
from .model_runner import CompileReport, ModelRunner
from .prompts import check_prompt
from .requests import InFlightWork, Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sent_steps import SentStep, StackedResults
from .step_cache import RunnerSpec, StepCache, StepLowering
from .step_shapes import StepShape, select_step_shape

__all__ = ["Engine", "check_engine_config", "lower_ahead", "resolve"]

STEPS_IN_FLIGHT = 2
"""Steps sent and not yet read back when `Engine.step` returns: the device has the next step queued while the
host reads one back and plans another."""


def resolve(model_config: ModelConfig, config: EngineConfig | None = None) -> tuple[EngineConfig, int]:
    """(`config` resolved for this platform and model (`EngineConfig.resolved`), its ``max_model_len``)."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
    chunks = (model_config.attention_chunk_size,) if "chunked_attention" in model_config.layer_types else ()
    config = config.resolved(platform=jax.default_backend(), chunk_sizes=chunks)
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    return config, max_model_len


def check_engine_config(model_config: ModelConfig, config: EngineConfig | None = None, *, dtype) -> int:
    """What an `Engine` of a model of `model_config` (weights in `dtype`) and `config` would refuse, found before
    the model exists: ``max_model_len`` beyond the model's, more `tensor_parallel` devices than there are, a KV
    cache dtype or size that does not serve one request (`KVCacheLayout.for_engine`). Returns ``max_model_len``."""
    config, max_model_len = resolve(model_config, config)
    tensor_parallel_mesh(config.tensor_parallel)
    KVCacheLayout.for_engine(model_config, config, max_model_len=max_model_len, dtype=dtype)
    return max_model_len


def _exports(config: EngineConfig) -> bool:
    """Whether the engine's step functions go through `jax.export` (kept in a cache or lowered by workers)."""
    return (config.compilation_cache is not None or config.compile_workers > 0) and not config.interpret


def _start_lowering(spec: RunnerSpec, config: EngineConfig) -> StepLowering:
    cache = None if config.compilation_cache is None else StepCache(config.compilation_cache)
    return StepLowering(spec, cache=cache, workers=config.compile_workers)


def lower_ahead(model_config: ModelConfig, config: EngineConfig | None = None, *, dtype) -> StepLowering | None:
    """Start lowering the step functions of an engine of `model_config` and `config` whose `Decoder` will hold
    weights and activations in `dtype` (as `load_model` gives it), before that model exists: on a GPU, worker
    processes lower them while the caller loads the weights. Pass the result as ``Engine(..., lowering=...)``; None
    when the engine would lower them itself (no cache and no workers)."""
    config, max_model_len = resolve(model_config, config)
    if not _exports(config) or config.tensor_parallel != 1:
        return None
    spec = RunnerSpec.of_config(model_config, config, max_model_len, dtype=dtype, param_dtype=dtype)
    return _start_lowering(spec, config)


class Engine:
    """Serve a `Decoder` with continuous batching, chunked prefill, prefix caching and preemption.

    Args:
      model: the `Decoder` (its weights are captured at construction).
      model_config: its `ModelConfig`.
      config: the `EngineConfig`.
      eos_token_ids: the tokens that end a request (unless its `SamplingParams.ignore_eos`).
      lowering: the step functions lowering already (`lower_ahead`), used when its spec is this engine's.
    """

    def __init__(
        self,
        model,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
        lowering: StepLowering | None = None,
    ):
        config, max_model_len = resolve(model_config, config)
        self.config, self.model_config = config, model_config
        self.eos_token_ids = frozenset(check_int("eos_token_ids", t, minimum=0) for t in eos_token_ids)
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, model_config, config, max_model_len=max_model_len)
        # how a worker process rebuilds the runner to lower its step functions (None: only this process can, or
        # the step functions are neither kept nor lowered by workers)
        self._spec = None
        if _exports(config):
            self._spec = RunnerSpec.of(model, model_config, config, max_model_len)
        self._lowering = lowering if lowering is not None and self._spec == lowering.spec else None
        self.layout, self.allocator_config = self.runner.layout, self.runner.allocator_config
        self.stats = EngineStats()
        self._device_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jha-device")
        self._device_calls: list[Future] = []  # calls on the worker whose errors are not yet looked at
        self._in_flight: collections.deque[SentStep] = collections.deque()  # sent, not yet read back, oldest first
        self._deferred_rows = False  # the last step read back deferred rows: the next one serves every row
        self._common_prefix_tokens = 0  # the full-attention layers' shared prefix in the last step read back
        self._last_read = time.perf_counter()
        self.scheduler = Scheduler(config, max_model_len=max_model_len, manager=self.manager,
                                   on_device=self._on_device, eos_token_ids=self.eos_token_ids)  # fmt: skip

    @property
    def manager(self) -> KVCacheManager:
        """The allocator (the model runner's)."""
        return self.runner.manager

    def compile(self, *, progress: Callable[[str], None] | None = None, warm_up: bool | None = None) -> CompileReport:
        """Compile every step shape (`ModelRunner.compile`; `progress(name)` as each is ready), then with `warm_up`
        (default: on a GPU) run each once on an idle plan (`ModelRunner.warm_up`). The first `step` calls it when
        nobody has; after it, serving compiles nothing. Returns what it did (also in `stats`)."""
        lowering, self._lowering = self._lowering, None
        if lowering is None and self._spec is not None:
            lowering = _start_lowering(self._spec, self.config)
        report = self.runner.compile(progress=progress, lowering=lowering)
        if jax.default_backend() == "gpu" if warm_up is None else warm_up:  # on the device worker, in order
            report.warm_up_s = self._on_device(self.runner.warm_up).result()
        self.stats.compile_time += report.wall_s + report.warm_up_s
        self.stats.compiled_executables += report.executables
        return report

    # ------------------------------------------------------------------------------------------- requests

    def add_request(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, *, request_id=None
    ) -> Hashable:
        """Queue a request; returns its id. Raises `ValueError` (naming the argument) for an empty prompt, ids
        outside the vocabulary, a prompt that leaves no room for a token within `max_model_len`, or a duplicate
        id, and `NotImplementedError` for a prompt holding a multimodal checkpoint's image token
        (`prompts.check_prompt`); the engine and the other requests are unchanged."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is not None:
            check_request_id(request_id)
        tokens = check_prompt(prompt_token_ids, model_config=self.model_config, max_model_len=self.max_model_len)
        return self.scheduler.add(tokens.tolist(), sampling, request_id=request_id)

    def abort_request(self, request_id: Hashable) -> RequestOutput | None:
        """Stop a request now: a waiting one leaves the queue, a running one frees its blocks in every KV-cache
        group (on the device worker, after the steps already sent: the tokens those compute for it are dropped).
        Returns its output so far (finish reason "abort"), or None when the engine holds no such request."""
        return self.scheduler.abort(request_id)

    def reset(self) -> None:
        """Forget the prefix cache and the serving counters (compiled step shapes stay, and so do `stats`'
        counts of them); refused while requests run."""
        if self.has_unfinished_requests():
            raise ValueError(f"reset() with {self.num_unfinished_requests} unfinished requests")
        self._on_device(self.manager.reset_prefix_cache)
        if self.scheduler.cached_prefixes is not None:
            self.scheduler.cached_prefixes.clear()
        self.synchronize()
        kept = {"compiled_executables": self.stats.compiled_executables, "compile_time": self.stats.compile_time}
        self.stats = EngineStats(**kept)

    def synchronize(self) -> None:
        """Wait until every device call made so far is sent (the caches and the allocator's state are then the
        engine's to read); raises the first error of such a call."""
        self._on_device(lambda: None).result()  # the worker runs calls in order: every earlier one is done
        self._raise_device_errors()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # ----------------------------------------------------------------------------------------------- step

    def step(self, on_token: Callable[[Hashable, int], None] | None = None) -> list[RequestOutput]:
        """One scheduling step: send the next step to the device, then read back the oldest step in flight once
        more than `STEPS_IN_FLIGHT` are. Returns the requests that finished in the step read back;
        `on_token(request_id, token)` is called for each of its tokens. The device calls it makes may still be
        queued when it returns (`synchronize`)."""
        if not self.runner.compiled:
            self.compile()
        rows = self.scheduler.schedule()
        if rows:
            self._in_flight.extend(self._send(rows, row_steps=self._decode_row_steps(rows)))
        elif not self._in_flight:
            if self.has_unfinished_requests():  # every request left is either running or waiting
                raise RuntimeError(f"no step to run for {self.num_unfinished_requests} unfinished requests")
            return []
        finished = []
        if not rows:
            finished = self._read(self._in_flight.popleft(), on_token)
        while len({id(sent.call) for sent in self._in_flight}) > STEPS_IN_FLIGHT:  # device calls, not steps
            finished += self._read(self._in_flight.popleft(), on_token)
        while self._in_flight and not self.has_unfinished_requests():
            self._read(self._in_flight.popleft(), on_token)  # only tokens past a stop token: nothing to keep
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: Callable[[Hashable, int], None] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (token id lists) to completion; one `RequestOutput` per prompt, in order. A prompt the
        engine refuses gets an output with `error` set and no tokens, and the others run."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts")
        outputs: dict[Hashable, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompts, sampling, strict=True):
            try:
                order.append(self.add_request(prompt, params))
            except (ValueError, NotImplementedError) as error:
                key = ("refused", len(order))
                order.append(key)
                outputs[key] = RequestOutput(key, list(prompt), [], None, error=str(error))
                if on_finish is not None:
                    on_finish(outputs[key])
        while self.has_unfinished_requests():
            for output in self.step(on_token):
                outputs[output.request_id] = output
                if on_finish is not None:
                    on_finish(output)
        self.synchronize()
        return [outputs[key] for key in order]

    # -------------------------------------------------------------------------------------------- helpers

    def _on_device(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the device worker, after every device call made before it."""
        call = self._device_worker.submit(fn, *args)
        self._device_calls.append(call)
        return call

    def _decode_row_steps(self, rows: list[tuple[Request, InFlightWork]]) -> list[int] | None:
        """Each row's steps in a call of ``decode_steps`` decode steps (at most the tokens its request has left
        before ``max_tokens`` or ``max_model_len``), or None for a call of one step: when some row does not decode
        (one token, then a draw), or has no decode read back yet (its first one frees every block its prompt left
        behind the window, which the allocator's sync-free path defers, with the rows after it, to the call's end
        when they are not cached), when the last step read back deferred rows, or when no row would take every
        step."""
        steps = self.config.decode_steps
        if steps == 1 or self._deferred_rows or self._cascade(rows):
            return None
        row_steps = []
        for request, work in rows:
            if work.num_tokens != 1 or not work.samples:
                return None
            if request.num_computed_tokens <= len(request.prompt_token_ids):  # no decode of it read back yet
                return None
            outputs = request.expected_num_outputs  # before this call's
            room = min(request.sampling.max_tokens, self.max_model_len - len(request.prompt_token_ids)) - outputs
            row_steps.append(min(steps, room))
        return row_steps if max(row_steps) == steps else None

    def _send(self, rows: list[tuple[Request, InFlightWork]], *, row_steps: list[int] | None = None
              ) -> list[SentStep]:  # fmt: skip
        """Send one device call of the rows' plan (through the worker; nothing is read back here): one step, or,
        with `row_steps`, ``decode_steps`` decode steps, row i in the first ``row_steps[i]``; one `SentStep` per
        step (its rows: None for a row not in it)."""
        lookups_may_hit = self.scheduler.lookups_may_hit(rows)  # before the rows' work is in flight
        columns = []  # per row: tokens, prompt length, seed, temperature, top-k, top-p
        for i, (request, work) in enumerate(rows):
            s = request.sampling
            columns.append((work.num_tokens, len(request.prompt_token_ids), request.seed, s.temperature, s.top_k,
                            s.top_p))  # fmt: skip
            request.in_flight.append(work)
            if row_steps is not None:
                request.in_flight.extend(InFlightWork(1, samples=True) for _ in range(row_steps[i] - 1))
        needs, prompt_lens, seeds, temperature, top_k, top_p = zip(*columns)
        pad = self.config.max_num_seqs - len(rows)

        def column(values, dtype, fill):
            return np.pad(np.asarray(values, dtype), (0, pad), constant_values=fill)

        plan = StepPlan(
            slots=None, max_new_tokens=column(needs, np.int32, 0), prompt_lens=column(prompt_lens, np.int32, 0),
            temperature=column(temperature, np.float32, 0), top_k=column(top_k, np.int32, 0),
            top_p=column(top_p, np.float32, 1), seeds=column(seeds, np.uint32, 0),
        )  # fmt: skip
        greedy_only = not bool((plan.temperature > 0).any())
        ids = [request.request_id for request, _ in rows]
        sent_rows = [(request, request.num_preemptions) for request, _ in rows]
        sent_at = time.perf_counter()
        if row_steps is not None:  # each step defers the rows it cannot serve at once (it never makes the host wait)
            self.stats.multi_step_calls += 1
            steps = column(row_steps, np.int32, 0)
            stacked = StackedResults(self._on_device(self._dispatch_steps, ids, plan, steps, greedy_only),
                                     num_rows=self.config.max_num_seqs)  # fmt: skip
            return [SentStep([row if n > j else None for row, n in zip(sent_rows, row_steps, strict=True)],
                             stacked, sent_at, self.config.max_num_seqs, index=j)
                    for j in range(self.config.decode_steps)]  # fmt: skip
        # The shape bounds what the device computes: prefix hits and earlier failures only lower it
        decode_only = max(needs) == 1
        shape = select_step_shape(self.runner.shapes, sum(needs), decode_only=decode_only,
                                  cascade=decode_only and self._cascade(rows))  # fmt: skip
        # A step lets the allocator defer the rows it cannot serve at once (then nothing in the step makes the host
        # wait for the device); the step after one that deferred rows serves every row, as does one that admits a
        # request that may hit the prefix cache (it would be deferred, and the rows after it).
        defer_rest = not (self._deferred_rows or lookups_may_hit)
        self.stats.cascade_steps += shape.cascade
        self._deferred_rows = False
        call = self._on_device(self._dispatch, ids, plan, shape, defer_rest, greedy_only)
        return [SentStep(sent_rows, call, sent_at, self.config.max_num_seqs)]

    def _cascade(self, rows: list[tuple[Request, InFlightWork]]) -> bool:
        """Whether a decode step of `rows` takes the cascade shape (`EngineConfig.cascade_attention`): its
        full-attention layers split off the prefix the rows share, which the last step read back measured (the
        device computes this step's own)."""
        if not self.config.cascade_step:
            return False
        if self.config.cascade_attention == "always":
            return True
        model = self.model_config
        return cascade_pays(
            num_reqs=len(rows), num_query_tokens=len(rows), prefix_len=self._common_prefix_tokens,
            num_q_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            kv_itemsize=self.layout.dtype.itemsize,
        )  # fmt: skip

    def _with_slots(self, plan: StepPlan, request_ids: list[Hashable]) -> StepPlan:
        """(On the device worker.) The plan with its requests' allocator slots (known once they are added)."""
        slots = [self.manager.slot(request_id) for request_id in request_ids]
        pad = self.config.max_num_seqs - len(slots)
        return plan._replace(slots=np.pad(np.asarray(slots, np.int32), (0, pad), constant_values=NO_SLOT))

    def _dispatch(
        self, request_ids: list[Hashable], plan: StepPlan, shape: StepShape, defer_rest: bool, greedy_only: bool
    ) -> jax.Array:
        """(On the device worker.) Send the step's calls through the model runner (its packed `StepResult`)."""
        plan = self._with_slots(plan, request_ids)
        return self.runner.run_step(plan, shape, defer_rest=defer_rest, greedy_only=greedy_only)

    def _dispatch_steps(
        self, request_ids: list[Hashable], plan: StepPlan, row_steps: np.ndarray, greedy_only: bool
    ) -> jax.Array:
        """(On the device worker.) Send a call of ``decode_steps`` decode steps through the model runner."""
        plan = self._with_slots(plan, request_ids)
        return self.runner.run_decode_steps(plan, row_steps, num_steps=self.config.decode_steps,
                                            greedy_only=greedy_only)  # fmt: skip

    def _read(self, sent: SentStep, on_token) -> list[RequestOutput]:
        """Read a step back: its tokens, finished requests, preemptions and counters."""
        result = sent.result()
        self._raise_device_errors()
        now = time.perf_counter()
        seconds = now - max(self._last_read, sent.sent_at)
        self._last_read = now
        outcome = self.scheduler.postprocess(sent.rows, result, now=now, on_token=on_token)
        if outcome.deferred_rows:
            self._deferred_rows = True
        self.stats.deferred_rows += outcome.deferred_rows
        self.stats.prompt_tokens += outcome.prompt_tokens
        self.stats.cached_prompt_tokens += outcome.cached_prompt_tokens
        full_attention_blocks = self.allocator_config.num_groups * sum(
            cdiv(r.num_computed_tokens, self.config.block_size) for r in self.scheduler.running
        )
        self.stats.record_step(
            int(result.num_scheduled.sum()), outcome.decode_tokens, seconds,
            blocks_in_use=self.layout.num_blocks - 1 - int(result.num_free_blocks),
            full_attention_blocks=full_attention_blocks,
        )  # fmt: skip
        self.stats.preemptions += self.scheduler.preempt(outcome.failed)
        config = self.allocator_config
        self._common_prefix_tokens = max(
            (int(blocks) * size for blocks, size, kind in
             zip(result.common_prefix_blocks, config.block_sizes, config.kinds, strict=True) if kind == FULL),
            default=0,
        )  # fmt: skip
        self.stats.peak_common_prefix_tokens = max(self.stats.peak_common_prefix_tokens, self._common_prefix_tokens)
        return outcome.finished

    def _raise_device_errors(self) -> None:
        """Raise the error of a device call that has run and failed; forget the calls that succeeded."""
        pending = []
        for call in self._device_calls:
            if not call.done():
                pending.append(call)
            elif call.exception() is not None:
                raise call.exception()
        self._device_calls = pending
