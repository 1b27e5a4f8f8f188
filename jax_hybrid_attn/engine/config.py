"""The engine's sizes and options (`EngineConfig`) and its counters (`EngineStats`)."""

import dataclasses

from ..integers import check_bool, check_int

__all__ = ["DEFAULT_MAX_MODEL_LEN", "EngineConfig", "EngineStats"]

DEFAULT_MAX_MODEL_LEN = 2048
"""``max_model_len`` when neither the engine config nor the model bounds it lower."""


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
      tensor_parallel: devices the model's heads and MLP are split over (the first `tensor_parallel` of
        `jax.devices()`, one mesh axis; `models.partitioning`). `kv_memory` is then each device's.
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
    tensor_parallel: int = 1

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel"):
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
    deferred_rows: int = 0  # rows a decode step's allocator left for the next step (they computed nothing)
    compile_steps: int = 0  # steps whose shape ran for the first time (compiled): not in the prefill/decode times
    compile_time: float = 0.0  # spent in the dispatches that compiled a step shape
    peak_blocks_in_use: int = 0
    peak_blocks_full_attention: int = 0  # what the same requests would hold with every group as full attention

    def record_step(
        self, num_tokens: int, decode_tokens: int, seconds: float, *, compiled: bool, blocks_in_use: int,
        full_attention_blocks: int,
    ) -> None:
        """Count one step read back: its tokens (`decode_tokens` of them decodes), its host wall time (a step
        that compiled is not timed; a step is a prefill step if it computes any prompt token), and the blocks in
        use after it, with what the same requests would hold with every group as full attention."""
        self.steps += 1
        self.compile_steps += compiled
        self.decode_tokens += decode_tokens
        self.prefill_tokens += num_tokens - decode_tokens
        if not compiled:
            self.timed_decode_tokens += decode_tokens
            self.timed_prefill_tokens += num_tokens - decode_tokens
            if num_tokens > decode_tokens:
                self.prefill_time += seconds
            else:
                self.decode_time += seconds
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks_in_use)
        self.peak_blocks_full_attention = max(self.peak_blocks_full_attention, full_attention_blocks)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.timed_prefill_tokens / self.prefill_time if self.prefill_time else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.timed_decode_tokens / self.decode_time if self.decode_time else None
