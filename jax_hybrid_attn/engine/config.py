"""The engine's sizes and options (`EngineConfig`) and its counters (`EngineStats`)."""

import dataclasses
import os

import numpy as np

from ..integers import check_bool, check_int

__all__ = ["DEFAULT_MAX_MODEL_LEN", "DEFAULT_SIZES", "DEFAULT_BLOCK_SIZE", "EngineConfig", "EngineStats"]

DEFAULT_MAX_MODEL_LEN = 2048
"""``max_model_len`` when neither the engine config nor the model bounds it lower."""
DEFAULT_SIZES = {"gpu": (256, 8192), "other": (16, 512)}
"""(``max_num_seqs``, ``max_num_batched_tokens``) by platform when the config gives none: vLLM's on a GPU, small
ones elsewhere (a CPU runs tests and the embedded demo)."""
DEFAULT_BLOCK_SIZE = 16
"""``block_size`` when none is given, halved until it divides every chunk of the model."""
IMPLEMENTATIONS = ("kernel", "reference")
"""`EngineConfig.implementation`'s values besides None (`validation.IMPLEMENTATIONS`, which imports jax)."""
CASCADE_MODES = ("auto", "always", "off")
"""`EngineConfig.cascade_attention`'s values."""
DEFAULT_COMPILE_WORKERS = 8
"""``compile_workers`` on a GPU when none is given (lowering the kernels is most of a step's compile time)."""


def _interpret(value):
    """`value` as `paged_attention` takes `interpret`: a bool, or the kernels' interpret parameters."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return bool(value)
    from .._compat import resolve_interpret  # here, not at import: the CLI builds its parser without jax

    resolve_interpret(value)  # ValueError naming it for anything else
    return value


def _cache_dtype(value):
    """`value` as a dtype of `layout.KV_CACHE_DTYPES`, or a ValueError naming it."""
    import jax.numpy as jnp  # here, not at import: the CLI builds its parser without jax

    from ..layout import KV_CACHE_DTYPES

    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={value!r} must be None or one of {[d.name for d in KV_CACHE_DTYPES]}")
    return dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine's sizes and options (vLLM's names).

    Attributes:
      block_size: S, tokens per KV block (None: `DEFAULT_BLOCK_SIZE`, or the largest power of two below it that
        divides every ``attention_chunk_size`` of the model).
      max_num_seqs: R, requests in flight at once (None: `DEFAULT_SIZES` of the platform).
      max_model_len: most tokens of one request, prompt and output (None: the model's maximum, at most
        `DEFAULT_MAX_MODEL_LEN`).
      max_num_batched_tokens: the token budget of one step, prefill chunks and decodes together (None:
        `DEFAULT_SIZES` of the platform).
      num_blocks, kv_memory: the KV pool, in blocks or bytes (at most one; neither: room for `max_num_seqs`
        requests of `max_model_len` tokens at once, in this layout).
      hybrid: allocate sliding-window and chunked layers as such (False: every layer as full attention).
      kv_cache_dtype: the cache's dtype: None (the model's), or float8_e4m3fn (half a bfloat16 cache's bytes;
        each layer's K and V stored divided by its scales, the checkpoint's ``self_attn.k_scale`` /
        ``v_scale`` where it has them and 1.0 otherwise, as vLLM's ``--kv-cache-dtype fp8``
        (`models.KVCacheScale`): larger values saturate at 448 times the scale).
      enable_prefix_caching: share cached prompt blocks across requests.
      sliding_window_in_window_only: clip prefill chunks so that sliding-window groups never allocate a block
        that is freed a step later (`AllocatorConfig`): a lower peak, but windows of W tokens then cap the chunks.
      seed: seeds requests that give none (request i gets ``seed + i``).
      implementation, interpret: as `paged_attention` (default: the kernels on a GPU, the reference elsewhere).
      tensor_parallel: devices the model's heads and MLP are split over (the first `tensor_parallel` of
        `jax.devices()`, one mesh axis; `models.partitioning`). `kv_memory` is then each device's.
      compilation_cache: a directory that keeps the lowered step functions across processes (`step_cache`; for
        XLA's executables too, point JAX's persistent cache there first: `step_cache.use_compilation_cache`).
      compile_workers: processes that lower the step functions in parallel before serving (None: 8 on a GPU,
        none elsewhere; 0: lower in this process).
      decode_steps: when every scheduled request decodes and none could reach a length limit sooner, one device
        call runs this many decode steps, each feeding its tokens to the next (`device_step.decode_steps`); 1:
        one step per call.
      cascade_attention: decode steps whose requests share a prompt prefix compute it as cascade attention
        (`cascade`: the prefix's blocks read once per step, not once per request) on full-attention layers:
        "auto" where the cost rule (`cascade.cascade_pays`) says it pays, on the kernels of one device (one more
        decode step compiled); "always" for every decode step (tests, measurements); "off".
      fuse_projections: serve layers whose q/k/v projections, and dense MLPs' gate/up projections, are fused into
        one Linear each, their weights concatenated once when the engine stacks them
        (`models.layer_scan.ScannedDecoder.from_decoder`): one matmul per group, where XLA would otherwise
        concatenate the weights inside the scanned layers at every step. The model passed in keeps transformers'
        layout. Ignored when ``tensor_parallel`` > 1: a fused ``[q|k|v]`` weight cannot be split column-parallel
        by whole heads.
      cublas_matmuls: compile the forward steps with every matmul on cuBLAS (XLA's Triton GEMMs off) and XLA's
        dynamic-slice fusion on (`model_runner.CUBLAS_MATMUL_OPTIONS`): a scan over layers then hands cuBLAS each
        layer's weights in place in their stack, where Triton GEMMs need them copied out first at every step
        (on by default). Nothing changes on a CPU.
    """

    block_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
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
    compilation_cache: str | None = None
    compile_workers: int | None = None
    decode_steps: int = 1
    cascade_attention: str = "auto"
    fuse_projections: bool = True
    cublas_matmuls: bool = True

    def __post_init__(self):
        object.__setattr__(self, "tensor_parallel", check_int("tensor_parallel", self.tensor_parallel))
        if self.compile_workers is not None:
            object.__setattr__(self, "compile_workers", check_int("compile_workers", self.compile_workers, minimum=0))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "decode_steps"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name)))
        for name in ("max_model_len", "num_blocks", "kv_memory"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), maximum=None))
        if self.num_blocks is not None and self.kv_memory is not None:
            raise ValueError(f"give at most one of num_blocks={self.num_blocks} and kv_memory={self.kv_memory}")
        for name in ("hybrid", "enable_prefix_caching", "sliding_window_in_window_only", "fuse_projections",
                     "cublas_matmuls"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0, maximum=2**32 - 1))
        if self.kv_cache_dtype is not None:
            object.__setattr__(self, "kv_cache_dtype", _cache_dtype(self.kv_cache_dtype))
        if self.cascade_attention not in CASCADE_MODES:
            raise ValueError(f"cascade_attention={self.cascade_attention!r} must be one of {CASCADE_MODES}")
        object.__setattr__(self, "interpret", _interpret(self.interpret))
        if self.implementation not in (None, *IMPLEMENTATIONS):
            raise ValueError(f"implementation={self.implementation!r} must be None or in {IMPLEMENTATIONS}")
        if self.implementation == "reference" and self.interpret is not False:
            raise ValueError(f"interpret={self.interpret!r} runs the kernels, not implementation='reference'")
        cache = self.compilation_cache
        if cache is not None and (not isinstance(cache, (str, os.PathLike)) or not os.fspath(cache)):
            raise ValueError(f"compilation_cache={cache!r} must be None or a directory's path")
        if self.cascade_attention == "always" and self.tensor_parallel > 1:
            raise NotImplementedError(f"cascade_attention='always' with tensor_parallel={self.tensor_parallel}")

    @property
    def cascade_step(self) -> bool:
        """Whether the engine compiles a decode step with cascade attention (a resolved config)."""
        if self.cascade_attention == "auto":
            return self.implementation == "kernel" and not self.interpret and self.tensor_parallel == 1
        return self.cascade_attention == "always"

    def resolved(self, *, platform: str, chunk_sizes: tuple[int, ...] = ()) -> "EngineConfig":
        """This config with its None sizes chosen: `DEFAULT_SIZES` of `platform` ("gpu" or another), and a block
        size that divides every one of `chunk_sizes` (the model's ``attention_chunk_size``)."""
        if not isinstance(platform, str):
            raise ValueError(f"platform={platform!r} must be a str (jax's platform name)")
        if not isinstance(chunk_sizes, (tuple, list)):
            raise ValueError(f"chunk_sizes={chunk_sizes!r} must be a tuple of ints")
        chunk_sizes = tuple(check_int("chunk_sizes", chunk) for chunk in chunk_sizes)
        seqs, tokens = DEFAULT_SIZES["gpu" if platform == "gpu" else "other"]
        block_size = self.block_size
        if block_size is None:
            block_size = DEFAULT_BLOCK_SIZE
            while block_size > 1 and any(chunk % block_size for chunk in chunk_sizes):
                block_size //= 2
        workers = self.compile_workers
        if workers is None:
            workers = DEFAULT_COMPILE_WORKERS if platform == "gpu" else 0
        implementation = self.implementation  # as `paged_attention` resolves it, fixed here for worker processes
        if implementation is None:
            implementation = "kernel" if platform == "gpu" or self.interpret else "reference"
        return dataclasses.replace(
            self, block_size=block_size, max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens, compile_workers=workers,
            implementation=implementation,
        )  # fmt: skip


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started (host wall time of whole steps, in seconds)."""

    steps: int = 0
    num_decode_steps: int = 0  # steps that computed decodes only
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    cached_prompt_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    deferred_rows: int = 0  # rows a decode step's allocator left for the next step (they computed nothing)
    multi_step_calls: int = 0  # device calls of several decode steps (`EngineConfig.decode_steps`)
    cascade_steps: int = 0  # decode steps sent with cascade attention (`EngineConfig.cascade_attention`)
    peak_common_prefix_tokens: int = 0  # the longest prefix a step's rows shared on full-attention layers
    compiled_executables: int = 0  # by `Engine.compile`, before the first step
    compile_time: float = 0.0  # spent in `Engine.compile`
    blocks_in_use: int = 0  # after the last step read back
    peak_blocks_in_use: int = 0
    peak_blocks_full_attention: int = 0  # what the same requests would hold with every group as full attention

    def record_step(
        self, num_tokens: int, decode_tokens: int, seconds: float, *, blocks_in_use: int, full_attention_blocks: int
    ) -> None:
        """Count one step read back: its tokens (`decode_tokens` of them decodes), its host wall time (a step is a
        prefill step if it computes any prompt token), and the blocks in use after it, with what the same requests
        would hold with every group as full attention."""
        self.steps += 1
        self.decode_tokens += decode_tokens
        self.prefill_tokens += num_tokens - decode_tokens
        if num_tokens > decode_tokens:
            self.prefill_time += seconds
        else:
            self.decode_time += seconds
            self.num_decode_steps += 1
        self.blocks_in_use = blocks_in_use
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks_in_use)
        self.peak_blocks_full_attention = max(self.peak_blocks_full_attention, full_attention_blocks)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_time if self.decode_time else None
