"""A decoder's configuration: sizes, each layer's attention type, RoPE, norms, soft caps, sinks and MoE sizes,
and what each layer's attention and KV cache are (`layer_params`, `kv_cache_spec`). `ModelConfig.from_hf` and
`from_dir` read it from a transformers ``config.json`` (`hf_config`: nothing per checkpoint is hard-coded).
"""

import dataclasses
import os

from ..integers import check_int
from ..params import LayerAttentionParams
from ..spec import AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from .hf_config import (
    LANGUAGE_MODEL_TYPES,
    LAYER_TYPES,
    MULTIMODAL_WRAPPERS,
    SUPPORTED_ARCHITECTURES,
    read_config_dir,
    read_hf_config,
)
from .rope import RopeParameters

__all__ = ["SUPPORTED_ARCHITECTURES", "LANGUAGE_MODEL_TYPES", "MULTIMODAL_WRAPPERS", "LAYER_TYPES", "ModelConfig"]

_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What a `Decoder` builds and computes, per layer where layers differ (static, hashable).

    Attributes:
      architecture: the ``model_type`` of the language model (one of `LANGUAGE_MODEL_TYPES`).
      wrapper: the multimodal wrapper's ``model_type`` (``"gemma3"``, ``"llama4"``) when the checkpoint is one and
        is served as its language model, else None (`model_type` is the checkpoint's type either way).
      image_token_id: the wrapper's image placeholder token: a prompt holding it is refused (images are not
        supported). None without a wrapper.
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: the sizes.
      max_position_embeddings: the longest sequence the checkpoint supports.
      rms_norm_eps: every RMSNorm's epsilon.
      hidden_act: the MLP's activation, "silu" or "gelu_pytorch_tanh".
      layer_types: each layer's attention, one of `LAYER_TYPES`.
      sliding_window: W of the "sliding_attention" layers (the W most recent positions, the query's own
        included: transformers' convention is the same).
      attention_chunk_size: C of the "chunked_attention" layers.
      rope: each layer's RoPE, None for a layer without position embedding (Llama 4's NoPE layers).
      rope_interleaved: Llama 4's complex-pair RoPE instead of rotate-half.
      tie_word_embeddings: the LM head is the embedding matrix.
      query_pre_attn_scalar: Gemma's softmax scale is its inverse square root (None: ``head_dim ** -0.5``).
      attn_logit_softcapping: the attention logits' soft cap (Gemma 2).
      final_logit_softcapping: the output logits' soft cap (Gemma 2 and 3).
      attention_bias: q/k/v/o projections have biases.
      attention_sinks: each attention layer has a learned sink per query head (gpt-oss).
      num_experts, num_experts_per_tok: MoE sizes (0 without MoE).
      moe_layers: the layers whose MLP is the MoE (the others are dense).
      moe_intermediate_size: each expert's width where it differs from `intermediate_size` (Qwen 3 MoE; the
        dense layers then keep `intermediate_size`).
      norm_topk_prob: Qwen 3 MoE's router renormalizes the top k probabilities to sum to 1.
      intermediate_size_mlp: the dense MLP's width on Llama 4's non-MoE layers.
      use_qk_norm: Llama 4's L2 norm of q and k on its RoPE layers.
      attn_temperature_tuning, floor_scale, attn_scale: Llama 4's query scaling on its NoPE layers.
      bos_token_id, eos_token_ids, pad_token_id: the special token ids from config.json.
      quantization: how the checkpoint stores some weights: None, or "mxfp4" (gpt-oss's experts as
        ``*_blocks`` and ``*_scales``, dequantized on load as transformers does).
    """

    architecture: str
    wrapper: str | None = None
    image_token_id: int | None = None
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    rope: tuple[RopeParameters | None, ...]
    rope_interleaved: bool = False
    tie_word_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    attention_sinks: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_layers: tuple[int, ...] = ()
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    intermediate_size_mlp: int | None = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: str | None = None

    def __post_init__(self):
        if self.architecture not in LANGUAGE_MODEL_TYPES:
            raise NotImplementedError(
                f"architecture={self.architecture!r} is not supported (supported: {LANGUAGE_MODEL_TYPES})"
            )
        if self.wrapper is not None and MULTIMODAL_WRAPPERS.get(self.wrapper) != self.architecture:
            raise NotImplementedError(
                f"wrapper={self.wrapper!r} around architecture={self.architecture!r} is not supported "
                f"(supported: {MULTIMODAL_WRAPPERS})"
            )
        if self.image_token_id is not None:
            check_int("image_token_id", self.image_token_id, minimum=0)
        if self.moe_intermediate_size is not None:
            check_int("moe_intermediate_size", self.moe_intermediate_size)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(
                f"hidden_act={self.hidden_act!r} is not supported (supported: {_ACTIVATIONS})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types={self.layer_types!r} must have num_layers={self.num_layers} entries"
            )
        if len(self.rope) != self.num_layers:
            raise ValueError(f"rope has {len(self.rope)} entries, not num_layers={self.num_layers}")
        for layer_type in self.layer_types:
            if layer_type not in LAYER_TYPES:
                raise NotImplementedError(
                    f"layer type {layer_type!r} is not supported (supported: {LAYER_TYPES})"
                )
        if "sliding_attention" in self.layer_types:
            check_int("sliding_window", self.sliding_window)
        if "chunked_attention" in self.layer_types:
            check_int("attention_chunk_size", self.attention_chunk_size)
        for layer in self.moe_layers:
            check_int("moe_layers", layer, minimum=0, maximum=self.num_layers - 1)
        if self.moe_layers:
            check_int("num_experts", self.num_experts)
            check_int("num_experts_per_tok", self.num_experts_per_tok, maximum=self.num_experts)

    # --- reading config.json (`hf_config`) ------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """The config of the checkpoint directory `path` (its ``config.json``)."""
        return cls(**read_config_dir(path))

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """Read a transformers config dict (``config.json`` or ``PretrainedConfig.to_dict()``)."""
        return cls(**read_hf_config(config))

    @property
    def model_type(self) -> str:
        """The checkpoint's ``model_type``: the wrapper's, else the language model's."""
        return self.wrapper or self.architecture

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's MLP width."""
        return self.moe_intermediate_size or self.intermediate_size

    # --- per layer ------------------------------------------------------------------------------------

    @property
    def sm_scale(self) -> float:
        """The softmax scale of every layer: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar) ** -0.5

    def _check_layer(self, layer) -> int:
        return check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)

    def layer_params(self, layer: int) -> LayerAttentionParams:
        """Layer `layer`'s attention: its scale, window or chunk, and soft cap."""
        layer_type = self.layer_types[self._check_layer(layer)]
        return LayerAttentionParams(
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window if layer_type == "sliding_attention" else None,
            attention_chunk_size=self.attention_chunk_size if layer_type == "chunked_attention" else None,
            logits_soft_cap=self.attn_logit_softcapping,
        )

    def kv_cache_spec(self, layer: int, *, block_size: int, dtype, hybrid: bool = True) -> AttentionSpec:
        """Layer `layer`'s KV-cache spec: sliding and chunked layers keep only their window or chunk
        (``hybrid=False``: every layer is a `FullAttentionSpec`, the non-hybrid baseline)."""
        layer_type = self.layer_types[self._check_layer(layer)]
        common = dict(
            block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype
        )
        if not hybrid or layer_type == "full_attention":
            return FullAttentionSpec(**common)
        if layer_type == "sliding_attention":
            return SlidingWindowSpec(**common, sliding_window=self.sliding_window)
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=self.attention_chunk_size)

    def layer_has_sinks(self, layer: int) -> bool:
        """Whether layer `layer`'s attention has learned sinks."""
        self._check_layer(layer)
        return self.attention_sinks

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self._check_layer(layer) in self.moe_layers

    def layer_rope(self, layer: int) -> RopeParameters | None:
        """Layer `layer`'s RoPE (None: no position embedding)."""
        return self.rope[self._check_layer(layer)]

    def layer_kind(self, layer: int) -> tuple:
        """What layer `layer` computes beyond its weights (hashable): its attention type and parameters, RoPE,
        sinks and MLP. Layers of one kind have weights of the same shapes and run the same code, so a scan over
        the layers traces and compiles each kind once (`models.layer_scan`)."""
        return (
            self.layer_types[self._check_layer(layer)],
            self.layer_params(layer),
            self.layer_rope(layer),
            self.layer_has_sinks(layer),
            self.layer_is_moe(layer),
        )


# --- the readers, one per family ----------------------------------------------------------------------
