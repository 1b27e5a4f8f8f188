"""A vLLM (0.33) attention backend on `PagedAttentionBackend`: ``--attention-backend CUSTOM``.

Installed with this package, the ``vllm.general_plugins`` entry point calls `register`, which registers
`JaxHybridAttentionBackend` as vLLM's ``AttentionBackendEnum.CUSTOM``; vLLM uses it where the engine is started
with ``--attention-backend CUSTOM`` (``attention_config={"backend": "CUSTOM"}`` from Python). This module imports
vLLM: only vLLM (through the entry point) or code that has vLLM installed imports it.

How vLLM's pieces map onto the torch backend:

* `JaxHybridAttentionImpl` (one per layer): vLLM's `AttentionImpl` arguments become the layer's `AttentionLayer`
  (scale, sliding window, soft cap, sinks), so two layers of one KV-cache group with different windows each keep
  their own.
* `JaxHybridAttentionMetadataBuilder` (one per KV-cache group): owns one `PagedAttentionBackend` holding the
  group's layers (read from vLLM's forward context, with their float8 scales), and turns vLLM's
  `CommonAttentionMetadata` into `JaxHybridAttentionMetadata`: the arguments of `PagedAttentionBackend.plan`.
* `JaxHybridAttentionImpl.forward`: the first layer of a step plans (one packed import per step and group), every
  layer then calls `PagedAttentionBackend.run`, which writes the step's k/v into the layer's cache and attends in
  one jitted JAX call (``forward_includes_kv_cache_update`` stays True: vLLM calls no separate cache write).

KV cache: vLLM 0.33 allocates every layer's cache as a logical ``[B, slots, S, content]`` view and asks the
backend how K and V pack into it (`customize_spec`): two head slots (K, then V) of ``K*H`` elements per token,
with the layer-compact ``LBHNC`` layout, give ``[B, 2, S, K*H]``, a zero-copy view of the backend's "NHD" cache
``[B, 2, S, K, H]`` (`jax_hybrid_attn.get_kv_cache_shape`). An fp8 cache in blocks of a multiple of 64 tokens is
kept in "HND_VT" instead (`jax_hybrid_attn.layout.preferred_kv_layout`: V transposed per block, which the kernels'
float8 PV product reads as it is): the same bytes viewed as ``[B, 2, K, S, H]``. vLLM never reads the contents:
the backend writes them (``forward_includes_kv_cache_update``) and reads them.

Not supported (NotImplementedError naming the argument): ALiBi, encoder, encoder-only and cross attention,
non-causal or per-request causal batches, fused output quantization, and cache dtypes other than the model's
dtype and float8 e4m3. CUDA graphs: never captured (the attention runs eagerly between graph pieces).

Shape letters: T tokens · R requests · N query heads · K kv heads · H head size · B blocks · S block size ·
P blocks per request.
"""

import dataclasses
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from jax_hybrid_attn.layout import FP8_DTYPE, preferred_kv_layout

from .backend import AttentionLayer, PagedAttentionBackend

__all__ = [
    "BACKEND_CLASS_PATH",
    "JaxHybridAttentionBackend",
    "JaxHybridAttentionImpl",
    "JaxHybridAttentionMetadata",
    "JaxHybridAttentionMetadataBuilder",
    "register",
]

BACKEND_CLASS_PATH = "jax_hybrid_attn_torch.vllm_backend.JaxHybridAttentionBackend"
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
CACHE_DTYPES = ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES)
# What the Mosaic GPU kernels take (jax_hybrid_attn.kernels.mixed_batch.check_kernel_support)
KERNEL_HEAD_SIZE_MULTIPLE = 64
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def register() -> None:
    """Register `JaxHybridAttentionBackend` as vLLM's ``AttentionBackendEnum.CUSTOM`` (the entry point of
    ``vllm.general_plugins``; calling it again is harmless)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)


class JaxHybridAttentionBackend(AttentionBackend):
    """vLLM's static side: names, capabilities, and how the KV cache is laid out."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = True  # `run` writes k/v and attends in one call

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["JaxHybridAttentionImpl"]:
        return JaxHybridAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["JaxHybridAttentionMetadataBuilder"]:
        return JaxHybridAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """K and V as two head slots of ``K*H`` elements per token: each layer's cache is ``[B, 2, S, K*H]``."""
        if spec.head_size_v != spec.head_size:
            raise NotImplementedError(
                f"head_size_v={spec.head_size_v} differs from head_size={spec.head_size}: K and V share one cache"
            )
        content = spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype)
        if (spec.num_head_slots, spec.state_content_bytes) == (2, content):
            return spec  # customized already
        if spec.state_content_bytes is not None or spec.num_head_slots is not None:
            raise NotImplementedError(
                f"a KV cache spec packed otherwise (num_head_slots={spec.num_head_slots}, "
                f"state_content_bytes={spec.state_content_bytes}, kv_quant_mode={spec.kv_quant_mode.name})"
            )
        return dataclasses.replace(spec, num_head_slots=2, state_content_bytes=content)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Layer-compact, head slot before token: a layer's cache is one compact ``[B, 2, S, K*H]`` tensor."""
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_combination(
        cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, use_mm_prefix,
        device_capability,
    ) -> str | None:  # fmt: skip
        """On a GPU (a device capability) the Mosaic GPU kernels run: bf16/fp16 and heads of a multiple of 64.
        Without one, the jnp reference serves any of `supported_dtypes` and head sizes."""
        if device_capability is None:
            return None
        if dtype not in KERNEL_DTYPES:
            return f"dtype={dtype}: the kernels take {KERNEL_DTYPES}"
        if head_size % KERNEL_HEAD_SIZE_MULTIPLE:
            return f"head_size={head_size}: the kernels take multiples of {KERNEL_HEAD_SIZE_MULTIPLE}"
        return None


@dataclasses.dataclass(kw_only=True, eq=False)
class JaxHybridAttentionMetadata:
    """One step's metadata of one KV-cache group: `PagedAttentionBackend.plan`'s arguments, planned on first use.

    Attributes:
      num_actual_tokens: T, the tokens the plan covers; forward's q/k/v/output rows past T are padding.
      query_start_loc: [R+1] int32; seq_lens: [R] int32; block_table: [R, P] int32; slot_mapping: [T] int64.
      max_query_len, max_seq_len: host-side upper bounds (no wait for the tensors).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plans: "_GroupPlans"

    def planned_backend(self) -> PagedAttentionBackend:
        """The group's backend with this step planned: the first call of a step plans, the others reuse it."""
        return self.plans.planned(self)


class _GroupPlans:
    """A KV-cache group's `PagedAttentionBackend` and the metadata it was last planned with: a step plans once,
    and a metadata built in between (another batch, a draft) is planned again when its layers run."""

    def __init__(self, backend: PagedAttentionBackend):
        self.backend = backend
        self.current: JaxHybridAttentionMetadata | None = None

    def planned(self, metadata: JaxHybridAttentionMetadata) -> PagedAttentionBackend:
        if self.current is not metadata:
            self.backend.plan(
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_table,
                metadata.slot_mapping,
                max_query_len=metadata.max_query_len,
                max_seq_len=metadata.max_seq_len,
                checked=False,  # vLLM's own metadata: checking its CUDA tensors would wait for them each step
            )
            self.current = metadata
        return self.backend


class JaxHybridAttentionMetadataBuilder(AttentionMetadataBuilder[JaxHybridAttentionMetadata]):
    """One KV-cache group's builder (vLLM's signature). Its `PagedAttentionBackend` is made at the first `build`,
    from the group's layers in ``vllm_config``'s forward context (after weight loading: float8 scales are read
    there)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None  # decodes and prefills in any order

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not isinstance(kv_cache_spec, AttentionSpec):
            raise NotImplementedError(
                f"kv_cache_spec of type {type(kv_cache_spec).__name__}: not an AttentionSpec"
            )
        self.block_size = kv_cache_spec.block_size
        fp8 = vllm_config.cache_config.cache_dtype in FP8_CACHE_DTYPES
        self.kv_layout = preferred_kv_layout(FP8_DTYPE, self.block_size) if fp8 else "NHD"
        self._plans: _GroupPlans | None = None

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> JaxHybridAttentionMetadata:
        """`PagedAttentionBackend.plan`'s arguments from vLLM's `CommonAttentionMetadata` (no copy, no wait)."""
        common = common_attn_metadata
        if common.causal is not True:
            causal = common.causal if not isinstance(common.causal, torch.Tensor) else "a per-request tensor"
            raise NotImplementedError(f"causal={causal}: only causal batches")
        num_tokens = common.num_actual_tokens
        return JaxHybridAttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping[:num_tokens],
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            plans=self._group_plans(),
        )

    def _group_plans(self) -> _GroupPlans:
        if self._plans is None:
            self._plans = _GroupPlans(
                PagedAttentionBackend(self._attention_layers(), block_size=self.block_size, kv_layout=self.kv_layout)
            )
        return self._plans

    def _attention_layers(self) -> dict[str, AttentionLayer]:
        context = self.vllm_config.compilation_config.static_forward_context
        layers = {}
        for name in self.layer_names:
            layer = context.get(name)
            impl = getattr(layer, "impl", None)
            if not isinstance(impl, JaxHybridAttentionImpl):
                found = (
                    "no such layer" if layer is None else f"{type(layer).__name__} with {type(impl).__name__}"
                )
                raise ValueError(
                    f"layer {name!r} of this KV-cache group must be an attention layer with a "
                    f"JaxHybridAttentionImpl in vllm_config's forward context, found {found}"
                )
            layers[name] = impl.attention_layer(layer)
        return layers


class JaxHybridAttentionImpl(AttentionImpl[JaxHybridAttentionMetadata]):
    """One layer (vLLM's positional signature). The window, soft cap, scale and sinks are this layer's own.

    Args:
      num_heads, head_size, num_kv_heads: N, H, K (num_kv_heads None: N).
      scale: logits scale.
      sliding_window: the W most recent positions, the query's own included (None: full attention).
      kv_cache_dtype: "auto" (the model's dtype), "float16", "bfloat16", or "fp8" / "fp8_e4m3" (float8 e4m3 with the
        layer's k/v scales).
      logits_soft_cap: ``cap * tanh(logits / cap)`` (None or 0: none).
      kv_sharing_target_layer_name: the layer whose cache this one reads (it writes nothing).
      sinks: [N] learned sink logits (gpt-oss), or None.
    Raises:
      NotImplementedError: alibi_slopes, an attn_type other than decoder, another kv_cache_dtype, or other options.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **options: Any,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError(f"alibi_slopes={alibi_slopes!r}: ALiBi is not supported")
        if attn_type != AttentionType.DECODER:
            name = getattr(attn_type, "value", attn_type)
            raise NotImplementedError(f"attn_type={name!r}: only decoder self-attention ('decoder')")
        if kv_cache_dtype not in CACHE_DTYPES:
            raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r}: supported are {CACHE_DTYPES}")
        if options:
            raise NotImplementedError(f"options {options!r}: not supported by JaxHybridAttentionImpl")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.attention_layer(None)  # the argument checks of AttentionLayer, now

    def attention_layer(self, layer: torch.nn.Module | None) -> AttentionLayer:
        """This layer as the torch backend's `AttentionLayer`; `layer` (vLLM's `Attention`) gives float8 scales."""
        scales = {}
        if self.kv_cache_dtype in FP8_CACHE_DTYPES and layer is not None:
            scales = {"k_scale": float(layer._k_scale_float), "v_scale": float(layer._v_scale_float)}
        return AttentionLayer(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            **scales,
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: JaxHybridAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's k/v into the layer's cache, attend, and fill `output` (vLLM's signature).

        Args:
          layer: vLLM's `Attention` module (its `layer_name` names the layer in the group's backend).
          query: [T', N, H]; key, value: [T', K, H] (T' >= T: rows past the metadata's T are padding and left alone).
          kv_cache: [B, 2, S, K*H] (vLLM's view of this backend's spec) or [B, 2, S, K, H] (`backend_cache`).
          attn_metadata: the layer's group's metadata; None in vLLM's profiling run (output is zeroed).
          output: [T', N, H], written in place.
        Returns:
          output.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "output_scale / output_block_scale: fused output quantization is not supported"
            )
        if attn_metadata is None:
            return output.fill_(0)
        backend = attn_metadata.planned_backend()
        num_tokens = attn_metadata.num_actual_tokens
        writes = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        backend.run(
            layer.layer_name,
            query[:num_tokens],
            key[:num_tokens] if writes else None,
            value[:num_tokens] if writes else None,
            self.backend_cache(kv_cache, kv_layout=backend.kv_layout),
            out=output[:num_tokens],
        )
        return output

    def backend_cache(self, kv_cache: torch.Tensor, *, kv_layout: str = "NHD") -> torch.Tensor:
        """vLLM's [B, 2, S, K*H] view as the backend's cache, zero-copy: [B, 2, S, K, H] ("NHD"), or the same bytes
        as [B, 2, K, S, H] ("HND_VT"); float8 caches come as uint8."""
        num_kv_heads, head_size = self.num_kv_heads, self.head_size
        if kv_cache.dim() == 4 and kv_cache.shape[1] == 2 and kv_cache.shape[3] == num_kv_heads * head_size:
            kv_cache = kv_cache.unflatten(3, (num_kv_heads, head_size))
        elif (
            kv_cache.dim() != 5
            or kv_cache.shape[1] != 2
            or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size)
        ):
            raise ValueError(
                f"kv_cache.shape={tuple(kv_cache.shape)} must be [B, 2, S, K*H={num_kv_heads * head_size}] "
                f"(JaxHybridAttentionBackend.customize_spec with the LBHNC layout) or [B, 2, S, K, H]"
            )
        if self.kv_cache_dtype in FP8_CACHE_DTYPES and kv_cache.dtype == torch.uint8:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        if kv_layout == "HND_VT":  # the block's bytes as [2, K, S, H] (contiguous: a view)
            num_blocks, _, block_size, _, _ = kv_cache.shape
            kv_cache = kv_cache.view(num_blocks, 2, num_kv_heads, block_size, head_size)
        return kv_cache
