"""The continuous-batching engine: requests in, tokens out, on the hybrid allocator and the paged kernels.

One `Engine.step`:
  1. schedule (host): the admitted requests in arrival order, then new ones while request slots are free, each
     with as many tokens as it still needs (its prompt in chunks, or one decode token) within the token budget;
  2. allocate (device): `KVCacheManager.schedule` finds prefix hits and hands out blocks in every KV-cache group
     (`StepOutput`);
  3. run (device, one jitted call): `metadata_from_step` per group, the model's forward through `PagedCache`
     (each layer writes its K/V by slot and attends, `layer_attention`), logits of each row's last token only,
     and sampling (`sample_tokens`);
  4. the sampled tokens go back to the allocator on the device (for prefix hashing), then to the host, the
     only read of the step: each request that finished its prompt or decoded gets its token, stops at
     an end or stop token, `max_tokens` or `max_model_len`, and frees its blocks;
  5. a running request that got no blocks preempts the newest running request (its blocks are freed; it is
     recomputed later, from its prompt and outputs, with prefix hits on what is still cached).

Shape letters: T tokens of the step · R rows (request slots) · V vocabulary.
"""

import collections
import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..allocator import KVCacheManager, StepOutput
from ..integers import cdiv, check_bool, check_int
from ..metadata import metadata_from_step
from ..models.config import ModelConfig
from .kv_layout import KVCacheLayout
from .paged_cache import PagedCache
from .requests import FinishReason, Request, RequestOutput
from .sampling import SamplingParams, sample_tokens

__all__ = ["Engine", "EngineConfig", "EngineStats"]

DEFAULT_MAX_MODEL_LEN = 2048
"""``max_model_len`` when neither the engine config nor the model bounds it lower."""


def _bucket(value: int, *, minimum: int = 1) -> int:
    """Static sizes are rounded up to a power of two, so that few shapes compile."""
    return max(minimum, 1 << (max(value, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine's sizes and options (vLLM's names).

    Attributes:
      block_size: S, tokens per KV block.
      max_num_seqs: R, requests in flight at once.
      max_model_len: most tokens of one request, prompt and output (None: the model's maximum, at most
        `DEFAULT_MAX_MODEL_LEN`).
      max_num_batched_tokens: the token budget of one step (prefill chunks and decodes together).
      num_blocks, kv_memory: the KV pool, in blocks or bytes (at most one; neither: room for `max_num_seqs`
        requests of `max_model_len` tokens at once, in this layout).
      hybrid: allocate sliding-window and chunked layers as such (False: every layer as full attention).
      kv_cache_dtype: the cache's dtype (None: the model's).
      enable_prefix_caching: share cached prompt blocks across requests.
      sliding_window_in_window_only: clip prefill chunks so that sliding-window groups never allocate a block
        that is freed a step later (`AllocatorConfig`): a lower peak, but windows of W tokens then cap the chunks.
      seed: seeds requests that give none (request i gets ``seed + i``).
      implementation, interpret: as `paged_attention` (default: the kernels on a GPU, the reference elsewhere).
    """

    block_size: int = 16
    max_num_seqs: int = 16
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    num_blocks: int | None = None
    kv_memory: int | None = None
    hybrid: bool = True
    kv_cache_dtype: object = None
    enable_prefix_caching: bool = True
    sliding_window_in_window_only: bool = False
    seed: int = 0
    implementation: str | None = None
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        for name in ("max_model_len", "num_blocks", "kv_memory"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), maximum=None))
        if self.num_blocks is not None and self.kv_memory is not None:
            raise ValueError(f"give at most one of num_blocks={self.num_blocks} and kv_memory={self.kv_memory}")
        for name in ("hybrid", "enable_prefix_caching", "sliding_window_in_window_only"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0, maximum=2**32 - 1))


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (host wall time of whole steps, in seconds)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    timed_prefill_tokens: int = 0  # in steps that did not compile, over prefill_time
    timed_decode_tokens: int = 0  # in decode-only steps that did not compile, over decode_time
    prefill_time: float = 0.0
    decode_time: float = 0.0
    cached_prompt_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    compile_steps: int = 0  # steps whose shape ran for the first time (compiled): not in the prefill/decode times
    compile_time: float = 0.0
    peak_blocks_in_use: int = 0
    peak_blocks_full_attention: int = 0  # what the same requests would hold with every group as full attention

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.timed_prefill_tokens / self.prefill_time if self.prefill_time else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.timed_decode_tokens / self.decode_time if self.decode_time else None


class Engine:
    """Serve a `Decoder` with continuous batching, chunked prefill, prefix caching and preemption.

    Args:
      model: the `Decoder` (its weights are captured at construction).
      model_config: its `ModelConfig`.
      config: the `EngineConfig`.
      eos_token_ids: the tokens that end a request (unless its `SamplingParams.ignore_eos`).
    """

    def __init__(
        self,
        model,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
    ):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config, self.model_config = config, model_config
        self.eos_token_ids = frozenset(check_int("eos_token_ids", t, minimum=0) for t in eos_token_ids)
        max_model_len = config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        graphdef, state = nnx.split(model)
        dtype = config.kv_cache_dtype or model.dtype  # the activations' dtype: k and v are written in it
        self.layout = KVCacheLayout.for_model(
            model_config, block_size=config.block_size, max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs, dtype=dtype,
            num_blocks=config.num_blocks, kv_memory=config.kv_memory, hybrid=config.hybrid,
        )  # fmt: skip
        self.allocator_config = self.layout.allocator_config(
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, enable_caching=config.enable_prefix_caching,
            sliding_window_in_window_only=config.sliding_window_in_window_only,
        )  # fmt: skip
        self.manager = KVCacheManager(self.allocator_config)
        self.kv_caches = self.layout.allocate()
        self._weights = state
        self._run = jax.jit(
            partial(_run_step, graphdef, self.allocator_config, self.layout, config.implementation, config.interpret),
            static_argnames=("num_tokens", "max_query_len"),
            donate_argnames=("kv_caches",),
        )
        self.stats = EngineStats()
        self._shapes: set[tuple[int, int]] = set()  # step shapes run so far (compiled)
        self._waiting: collections.deque[Request] = collections.deque()
        self._admitted: list[Request] = []  # hold a request slot, in arrival order
        self._ids: set[Hashable] = set()
        self._next_index = 0

    # ------------------------------------------------------------------------------------------- requests

    def add_request(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, *, request_id=None
    ) -> Hashable:
        """Queue a request; returns its id. Raises `ValueError` (naming the argument) for an empty prompt, ids
        outside the vocabulary, a prompt that leaves no room for a token within `max_model_len`, or a duplicate
        id; the engine and the other requests are unchanged."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        tokens = np.asarray(prompt_token_ids)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"prompt_token_ids must be a non-empty flat sequence of ints, got {prompt_token_ids!r}")
        vocab = self.model_config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"prompt_token_ids hold ids in [{tokens.min()}, {tokens.max()}], outside [0, {vocab=})")
        if tokens.size >= self.max_model_len:
            raise ValueError(
                f"the prompt's {tokens.size} tokens leave no room for output within max_model_len={self.max_model_len}"
            )
        index = self._next_index
        request_id = index if request_id is None else request_id
        if request_id in self._ids:
            raise ValueError(f"{request_id=} is already in the engine")
        seed = sampling.seed if sampling.seed is not None else (self.config.seed + index) % 2**32
        self._waiting.append(Request(request_id, index, tokens.tolist(), sampling, seed))
        self._ids.add(request_id)
        self._next_index += 1
        return request_id

    def reset(self) -> None:
        """Forget the prefix cache and the counters (compiled step shapes stay); refused while requests run."""
        if self.has_unfinished_requests():
            raise ValueError(f"reset() with {self.num_unfinished_requests} unfinished requests")
        self.manager.reset_prefix_cache()
        self.stats = EngineStats()

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._admitted)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._admitted)

    # ----------------------------------------------------------------------------------------------- step

    def step(self, on_token: Callable[[Hashable, int], None] | None = None) -> list[RequestOutput]:
        """One scheduling step; returns the requests that finished in it. `on_token(request_id, token)` is
        called for each token as it is sampled."""
        rows = self._schedule()
        if not rows:
            return []
        started = time.perf_counter()
        ids = [request.request_id for request, _ in rows]
        budgets = [budget for _, budget in rows]
        out = self.manager.schedule(list(zip(ids, budgets)), wait=False)
        # The static shape comes from the plan (an upper bound: prefix hits only lower what is computed), so the
        # model is dispatched without reading the allocator's result; everything is read once, after sampling
        shape = dict(
            num_tokens=min(_bucket(sum(budgets), minimum=8), self.config.max_num_batched_tokens),
            max_query_len=1 if max(budgets) == 1 else self.config.max_num_batched_tokens,
        )
        known = np.zeros(self.config.max_num_seqs, np.int32)
        known[: len(rows)] = [request.num_tokens for request, _ in rows]
        tokens, sampled, self.kv_caches = self._run(
            self._weights, self.kv_caches, out, self._sampling_arrays(rows), jnp.asarray(known), **shape
        )
        self.manager.append_row_token_ids(ids, tokens, mask=sampled)
        success, seq_lens, hits, query_start_loc, tokens, sampled = jax.device_get(
            (out.success, out.seq_lens, out.num_new_computed_tokens, out.query_start_loc, tokens, sampled)
        )
        self.manager.record_step(ids, success, seq_lens)
        num_tokens = int(query_start_loc[-1])
        sampled_rows = [i for i in range(len(rows)) if sampled[i]]
        now = time.perf_counter()
        compiled = tuple(shape.values()) not in self._shapes
        if compiled:
            self._shapes.add(tuple(shape.values()))
        self._account(rows, success, seq_lens, hits, num_tokens, now - started, compiled=compiled)
        finished = []
        for i in sampled_rows:
            request = rows[i][0]
            token = int(tokens[i])
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if on_token is not None:
                on_token(request.request_id, token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_reason = reason
                finished.append(self._release(request))
        self._preempt_for(rows, success)
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
            except ValueError as error:
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
        return [outputs[key] for key in order]

    # -------------------------------------------------------------------------------------------- helpers

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's rows: (request, token budget), admitted requests first, in arrival order."""
        budget = self.config.max_num_batched_tokens
        while self._waiting and len(self._admitted) < self.config.max_num_seqs:
            request = self._waiting.popleft()
            self.manager.add_request(request.request_id, request.all_token_ids)
            request.admitted = True
            self._admitted.append(request)
        rows = []
        for request in self._admitted:
            need = min(request.num_tokens - request.num_computed_tokens, budget)
            if need > 0:
                rows.append((request, need))
                budget -= need
        return rows

    def _sampling_arrays(self, rows) -> dict[str, jax.Array]:
        width = self.config.max_num_seqs
        arrays = dict(
            temperature=np.zeros(width, np.float32), top_k=np.zeros(width, np.int32), top_p=np.ones(width, np.float32),
            seeds=np.zeros(width, np.uint32), token_index=np.zeros(width, np.int32),
        )  # fmt: skip
        for i, (request, _) in enumerate(rows):
            s = request.sampling
            arrays["temperature"][i], arrays["top_k"][i], arrays["top_p"][i] = s.temperature, s.top_k, s.top_p
            arrays["seeds"][i], arrays["token_index"][i] = request.seed, len(request.output_token_ids)
        return {name: jnp.asarray(value) for name, value in arrays.items()}

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        s = request.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(request.output_token_ids) >= s.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, request: Request) -> RequestOutput:
        self.manager.free(request.request_id)
        self._admitted.remove(request)
        self._ids.discard(request.request_id)
        return RequestOutput.of(request)

    def _account(self, rows, success, seq_lens, hits, num_tokens, seconds, *, compiled: bool) -> None:
        stats = self.stats
        stats.steps += 1
        stats.compile_steps += compiled
        stats.compile_time += seconds if compiled else 0.0
        decode_tokens = 0
        for i, (request, _) in enumerate(rows):
            if not success[i]:
                continue
            if request.num_computed_tokens == 0:
                stats.prompt_tokens += len(request.prompt_token_ids)
            request.num_cached_tokens += int(hits[i])
            stats.cached_prompt_tokens += int(hits[i])
            scheduled = int(seq_lens[i]) - request.num_computed_tokens - int(hits[i])
            if scheduled == 1 and request.output_token_ids:
                decode_tokens += 1
            request.num_computed_tokens = int(seq_lens[i])
        stats.decode_tokens += decode_tokens
        stats.prefill_tokens += num_tokens - decode_tokens
        if not compiled:  # a step is a prefill step if it computes any prompt token
            stats.timed_decode_tokens += decode_tokens
            stats.timed_prefill_tokens += num_tokens - decode_tokens
            if num_tokens > decode_tokens:
                stats.prefill_time += seconds
            else:
                stats.decode_time += seconds
        in_use = self.layout.num_blocks - 1 - self.manager.num_free_blocks
        full = self.allocator_config.num_groups * sum(
            cdiv(r.num_computed_tokens, self.config.block_size) for r in self._admitted
        )
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, in_use)
        stats.peak_blocks_full_attention = max(stats.peak_blocks_full_attention, full)

    def _preempt_for(self, rows, success) -> None:
        """Each running request that got no blocks preempts the newest running request (possibly itself)."""
        failed = [request for i, (request, _) in enumerate(rows) if not success[i] and request.num_computed_tokens]
        for request in failed:
            running = [r for r in self._admitted if r.num_computed_tokens > 0 and not r.finished]
            if request not in running:  # preempted already, as an earlier row's victim
                continue
            victim = max(running, key=lambda r: r.index)
            self.manager.preempt(victim.request_id)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.stats.preemptions += 1


def _run_step(
    graphdef, allocator_config, layout, implementation, interpret, weights, kv_caches, out: StepOutput, sampling,
    known_tokens, *, num_tokens: int, max_query_len: int,
):  # fmt: skip
    """The device half of a step, one jitted call: metadata per group, the model's forward over the paged caches,
    the logits of each row's last token, and sampling.

    A row samples when it got its blocks and its sequence now covers every token known for it (`known_tokens`,
    [R]): its prompt is complete, or it decoded. Returns ([R] tokens, [R] whether the row sampled, the caches)."""
    model = nnx.merge(graphdef, weights)
    metadata = tuple(
        metadata_from_step(allocator_config, out, group, max_query_len=max_query_len).replace(
            slot_mapping=out.slot_mappings[group, :num_tokens]
        )
        for group in range(allocator_config.num_groups)
    )
    cache = PagedCache(
        tensors=tuple(kv_caches), metadata=metadata, positions=out.positions[:num_tokens],
        layer_group=layout.layer_group, layer_tensor=layout.layer_tensor, implementation=implementation,
        interpret=interpret,
    )  # fmt: skip
    last_token = jnp.maximum(out.query_start_loc[1:] - 1, 0)
    logits, cache = model(out.token_ids[:num_tokens], cache, logits_indices=last_token)
    sampled = out.success & (out.seq_lens == known_tokens) & (out.num_scheduled_tokens > 0)
    return sample_tokens(logits, **sampling), sampled, cache.tensors
