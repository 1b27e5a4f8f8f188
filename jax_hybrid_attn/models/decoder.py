"""The decoder of every supported family, in Flax NNX, op by op as transformers 5.17 computes it.

One `Decoder` class reads its `ModelConfig` for what differs between families (norm placement and dtype
casts, q/k norms, RoPE layout and per-layer bases, sinks, biases, dense or MoE MLPs, soft caps). Its
parameters carry transformers' names and layouts (``model.layers.3.self_attn.q_proj.weight``, a Linear's
weight ``[out, in]``), so that loading a checkpoint is one name-for-name copy (`loading.py`). The shared blocks
(Linear, RMSNorm, the gated MLP) are in `layers`, the mixture-of-experts MLPs in `moe`.

Each layer calls ``cache.attend(layer, q, k, v, params=config.layer_params(layer), sinks=...)`` once; RoPE
uses ``cache.positions``. `Decoder.__call__` runs the layers as a Python loop; the serving engine runs them as
scans over the layers' repeating pattern (`layer_scan`), each kind of layer traced once, on copies of the layers
whose q/k/v and gate/up projections are fused into one Linear each (`DecoderLayer.fuse_projections`).

Shape letters: T tokens · R rows kept for the LM head · N query heads · K kv heads · H head size ·
D hidden size · I MLP width (an expert's in an MoE) · E experts · k experts per token · V vocabulary ·
L layers.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from .._compat import register_pytree_dataclass
from .attention_cache import AttentionCache
from .config import ModelConfig
from .layers import GatedMLP, Linear, RMSNorm, concatenate_weights, matmul, normal_param, per_head, rms_norm
from .moe import GptOssMLP, Llama4MoE, Qwen3MoeMLP
from .rope import RopeParameters, apply_rope

__all__ = ["Decoder", "DecoderEnds", "DecoderIntermediates", "KVCacheScale"]


@functools.cache
def _inv_freq(rope: RopeParameters, head_dim: int) -> tuple[np.ndarray, float]:
    return rope.inv_freq(head_dim)


def _l2_norm(x, eps: float):
    """Llama 4's weightless qk norm: ``normed(x_f32).astype(dtype)``."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, rngs, param_dtype):
        self.weight = normal_param(rngs, (vocab_size, hidden_size), param_dtype)


_QK_NORM_STYLES = {"gemma3_text": "gemma", "qwen3": "llama", "qwen3_moe": "llama"}
"""The families with an RMSNorm of q and k over each head before RoPE, and its style (`RMSNorm`)."""

_NORM_STYLES = {"gemma2": "gemma", "gemma3_text": "gemma", "gpt_oss": "f32"}
"""Each family's style of its layer and final norms (`RMSNorm`), "llama" where not listed."""


class KVCacheScale(nnx.Variable):
    """One layer's dequantization scale of its K or V in a float8 KV cache (K/V are stored divided by it), float32:
    a checkpoint's ``self_attn.k_scale`` / ``self_attn.v_scale`` (vLLM's names), 1.0 where it has none. No weight
    of the forward: only a cache that stores K/V in float8 uses it (`AttentionCache.attend`)."""


class Attention(nnx.Module):
    """One layer's q/k/v projections, q/k norms, RoPE, the cache's attention and the output projection.

    `fuse_projections` turns q/k/v into one ``qkv_proj`` (one matmul for the three, the same products) and the
    q/k norms into one ``qk_norm`` of a weight per head (the same values). That form is for serving
    (`layer_scan.ScannedDecoder`): its parameter names are no longer transformers', so a checkpoint loads into the
    unfused form."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs, dtype, param_dtype):
        d, n, kv, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        common = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Linear(d, n * h, bias=bias, **common)
        self.k_proj = Linear(d, kv * h, bias=bias, **common)
        self.v_proj = Linear(d, kv * h, bias=bias, **common)
        self.qkv_proj = nnx.data(None)  # `fuse_projections`: q's, k's and v's weights ``[(N + 2K)H, D]``
        self.o_proj = Linear(n * h, d, bias=bias, **common)
        qk_norm_style = _QK_NORM_STYLES.get(config.architecture)
        if qk_norm_style is not None:  # per head, before RoPE
            self.q_norm = RMSNorm(h, eps=config.rms_norm_eps, style=qk_norm_style, param_dtype=param_dtype)
            self.k_norm = RMSNorm(h, eps=config.rms_norm_eps, style=qk_norm_style, param_dtype=param_dtype)
        else:
            self.q_norm = None
            self.k_norm = None
        self.qk_norm = nnx.data(None)  # `fuse_projections`: the two norms' weights per head, ``[N + K, H]``
        self.sinks = normal_param(rngs, (n,), param_dtype) if config.layer_has_sinks(layer) else None
        self.k_scale = KVCacheScale(jnp.ones((), jnp.float32))
        self.v_scale = KVCacheScale(jnp.ones((), jnp.float32))
        self.layer = layer
        self.config = config

    def fuse_projections(self) -> None:
        """Replace `q_proj`, `k_proj` and `v_proj` by one `qkv_proj` whose weight is theirs concatenated
        (``[(N + 2K)H, D]``: q's rows, then k's, then v's), their biases likewise where the family has them. This
        module's new Linear holds the concatenation: the old ones are left as they are, so a copy of a module
        (`nnx.merge` of its split) fuses without touching the original. Where the family norms q and k per head,
        `q_norm` and `k_norm` become one `qk_norm` whose weight is q_norm's for each query head, then k_norm's
        for each kv head (``[N + K, H]``): the forward norms q's and k's heads as one array either way."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        weight = concatenate_weights([part.weight.get_value() for part in parts])
        bias = None if parts[0].bias is None else concatenate_weights([part.bias.get_value() for part in parts])
        self.qkv_proj = Linear.of_weight(weight, bias, dtype=parts[0].dtype)
        self.q_proj = self.k_proj = self.v_proj = None
        if self.q_norm is not None:
            self.qk_norm = RMSNorm.of_weight(self._qk_norm_weights(), eps=self.q_norm.eps, style=self.q_norm.style)
            self.q_norm = self.k_norm = None

    def _qk_norm_weights(self) -> Array:
        """[N + K, H]: `q_norm`'s weight for each query head, then `k_norm`'s for each kv head."""
        return concatenate_weights([per_head(self.q_norm.weight.get_value(), self.config.num_heads),
                                    per_head(self.k_norm.weight.get_value(), self.config.num_kv_heads)])  # fmt: skip

    def __call__(
        self, x: Float[Array, "T D"], cache: AttentionCache
    ) -> tuple[Float[Array, "T D"], AttentionCache]:
        config, layer = self.config, self.layer
        num_tokens = x.shape[0]
        h = config.head_dim
        # q's and k's heads as one array [T, N + K, H] for the per-head norms and RoPE: one kernel each on a GPU
        if self.qkv_proj is not None:
            qk, v = jnp.split(self.qkv_proj(x), [(config.num_heads + config.num_kv_heads) * h], axis=-1)
        else:
            qk, v = jnp.concatenate([self.q_proj(x), self.k_proj(x)], axis=-1), self.v_proj(x)
        qk = qk.reshape(num_tokens, config.num_heads + config.num_kv_heads, h)
        v = v.reshape(num_tokens, config.num_kv_heads, h)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        elif self.q_norm is not None:
            qk = rms_norm(qk, self._qk_norm_weights(), eps=self.q_norm.eps, style=self.q_norm.style)
        positions = cache.positions
        rope = config.layer_rope(layer)
        if rope is not None:
            inv_freq, scaling = _inv_freq(rope, h)
            qk = apply_rope(qk, positions, inv_freq, scaling, interleaved=config.rope_interleaved)
            if config.use_qk_norm:  # Llama 4: after RoPE, on RoPE layers only
                qk = _l2_norm(qk, config.rms_norm_eps)
        q, k = qk[:, : config.num_heads], qk[:, config.num_heads :]
        if rope is None and config.attn_temperature_tuning:  # Llama 4's NoPE layers
            scales = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / config.floor_scale))
            scales = scales * config.attn_scale + 1.0
            q = (q * scales[:, None, None]).astype(q.dtype)
        sinks = None if self.sinks is None else self.sinks[...]
        out, cache = cache.attend(layer, q, k, v, params=config.layer_params(layer), sinks=sinks,
                                  k_scale=self.k_scale[...], v_scale=self.v_scale[...])
        return self.o_proj(out.reshape(num_tokens, config.num_heads * h).astype(x.dtype)), cache


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP with residuals; Gemma adds a norm after each (four norms per layer).

    `fuse_projections` gives it one q/k/v projection and one gate/up projection: the serving form
    (`layer_scan.ScannedDecoder`), whose parameter names are no longer transformers' (checkpoints load into the
    unfused form)."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs, dtype, param_dtype):
        common = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        gemma = config.architecture in ("gemma2", "gemma3_text")
        style = _NORM_STYLES.get(config.architecture, "llama")
        norm = lambda: RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, style=style, param_dtype=param_dtype
        )
        self.self_attn = Attention(config, layer, **common)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if gemma else None
        self.post_feedforward_layernorm = norm() if gemma else None
        if config.architecture == "gpt_oss":
            mlp = GptOssMLP(config, **common)
        elif config.architecture == "llama4_text" and config.layer_is_moe(layer):
            mlp = Llama4MoE(config, **common)
        elif config.architecture == "llama4_text":
            mlp = GatedMLP(config, config.intermediate_size_mlp, **common)
        elif config.architecture == "qwen3_moe" and config.layer_is_moe(layer):
            mlp = Qwen3MoeMLP(config, **common)
        else:
            mlp = GatedMLP(config, config.intermediate_size, **common)
        # transformers' name: Llama 4's `feed_forward`, the others' `mlp`
        llama4 = config.architecture == "llama4_text"
        self.mlp = None if llama4 else mlp
        self.feed_forward = mlp if llama4 else None
        self.sandwich = gemma

    def fuse_projections(self) -> None:
        """Fuse the attention's q/k/v projections (`Attention.fuse_projections`) and a dense MLP's gate and up
        projections (`GatedMLP.fuse_projections`); an MoE MLP stays as it is. The layer then computes what it
        did, from the same products."""
        self.self_attn.fuse_projections()
        mlp = self.mlp if self.mlp is not None else self.feed_forward
        if isinstance(mlp, GatedMLP):
            mlp.fuse_projections()

    def __call__(self, x: Float[Array, "T D"], cache: AttentionCache) -> tuple[Float[Array, "T D"], AttentionCache]:
        x, _, cache = self.with_attention_output(x, cache)
        return x, cache

    def with_attention_output(
        self, x: Float[Array, "T D"], cache: AttentionCache
    ) -> tuple[Float[Array, "T D"], Float[Array, "T D"], AttentionCache]:
        """The layer's output, its attention block's output (after ``o_proj``, before any norm after it: what a
        hook on transformers' ``self_attn`` sees) and the cache. Under jit the second output costs nothing
        where it is dropped, as `__call__` drops it."""
        residual = x
        attention, cache = self.self_attn(self.input_layernorm(x), cache)
        if self.sandwich:
            x = residual + self.post_attention_layernorm(attention)
            h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + h, attention, cache
        x = residual + attention
        mlp = self.mlp if self.mlp is not None else self.feed_forward
        return x + mlp(self.post_attention_layernorm(x)), attention, cache


class TextModel(nnx.Module):
    """transformers' ``model``: the embedding, the layers and the final norm."""

    def __init__(self, config: ModelConfig, *, rngs, dtype, param_dtype):
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, rngs=rngs, param_dtype=param_dtype
        )
        self.layers = nnx.List(
            [
                DecoderLayer(config, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                for i in range(config.num_layers)
            ]
        )
        style = _NORM_STYLES.get(config.architecture, "llama")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, style=style, param_dtype=param_dtype)


@dataclasses.dataclass(frozen=True)
class DecoderIntermediates:
    """What a `Decoder`'s layers computed for T tokens (`Decoder.with_intermediates`), in the model's dtype.

    Attributes:
      embeddings: ``[T, D]`` the input of the first layer (Gemma's scaled embedding).
      hidden: ``[L, T, D]`` each layer's output (L layers), before the final norm.
      attention: ``[L, T, D]`` each layer's attention block's output, after ``o_proj``.
    """

    embeddings: Float[Array, "T D"]
    hidden: Float[Array, "L T D"]
    attention: Float[Array, "L T D"]


register_pytree_dataclass(DecoderIntermediates, data_fields=["embeddings", "hidden", "attention"], meta_fields=[])


class Decoder(nnx.Module):
    """A causal LM of any supported family (`ModelConfig.architecture`), with transformers' parameter names.

    ``Decoder(config, rngs=nnx.Rngs(0))`` has random weights (normal, std 0.02; norms at their identity);
    `jax_hybrid_attn.models.load_model` fills them from a checkpoint. `dtype` is the activations' dtype,
    `param_dtype` the stored weights'.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config={config!r} must be a ModelConfig")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.model = TextModel(config, rngs=rngs, dtype=self.dtype, param_dtype=param_dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size,
                config.vocab_size,
                bias=False,
                rngs=rngs,
                dtype=self.dtype,
                param_dtype=param_dtype,
            )
        )

    def __call__(
        self,
        token_ids: Int[Array, "T"],
        cache: AttentionCache,
        *,
        logits_indices: Int[Array, "R"] | None = None,
    ) -> tuple[Float[Array, "R V"], AttentionCache]:
        """Float32 logits of the rows `logits_indices` of this call's T tokens (all T when None), and the cache.

        The rows are gathered after the final norm and before the LM head, so a serving step computes the
        logits of the rows it samples only. The layers run one after another; `layer_scan.ScannedDecoder` runs
        the same computation as scans over the layers' pattern."""
        ends = DecoderEnds(self)
        x = ends.embed(token_ids)
        for layer in self.model.layers:
            x, cache = layer(x, cache)
        return ends.logits(x, logits_indices), cache

    def with_intermediates(
        self, token_ids: Int[Array, "T"], cache: AttentionCache
    ) -> tuple[Float[Array, "T V"], DecoderIntermediates, AttentionCache]:
        """`__call__` over every row, and what each layer computed on the way (`DecoderIntermediates`), for
        checks against another implementation layer by layer (`models.compare`); the serving path never calls it.
        """
        ends = DecoderEnds(self)
        x = embeddings = ends.embed(token_ids)
        hidden, attention = [], []
        for layer in self.model.layers:
            x, attended, cache = layer.with_attention_output(x, cache)
            hidden.append(x)
            attention.append(attended)
        intermediates = DecoderIntermediates(embeddings, jnp.stack(hidden), jnp.stack(attention))
        return ends.logits(x, None), intermediates, cache


class DecoderEnds(nnx.Module):
    """What a `Decoder` runs before and after its layers: the token embedding (Gemma scales it), and the final
    norm, the LM head (or the tied embedding) and the final soft cap. It holds the decoder's own modules (no
    copy), so that the layers can be run apart from it."""

    def __init__(self, decoder: Decoder):
        self.embed_tokens = decoder.model.embed_tokens
        self.norm = decoder.model.norm
        self.lm_head = decoder.lm_head
        self.config = decoder.config
        self.dtype = decoder.dtype

    def embed(self, token_ids: Int[Array, "T"]) -> Float[Array, "T D"]:
        config, dt = self.config, self.dtype
        x = self.embed_tokens.weight[...][token_ids].astype(dt)
        if config.architecture in ("gemma2", "gemma3_text"):
            x = x * jnp.asarray(math.sqrt(config.hidden_size), dt)  # in the dtype, as transformers does
        return x

    def logits(self, x: Float[Array, "T D"], logits_indices: Int[Array, "R"] | None, *,
               float32: bool = True) -> Float[Array, "R V"]:  # fmt: skip
        """Float32 logits of the rows `logits_indices` of `x` (every row when None). Without `float32`, in the LM
        head's dtype where the model has no final soft cap: the same values before their conversion, for a
        caller that converts them as it reads them (a serving step's sampler), so that no kernel writes them
        twice."""
        config, dt = self.config, self.dtype
        x = self.norm(x)
        if logits_indices is not None:
            x = x[logits_indices]
        if self.lm_head is None:
            logits = matmul(x, self.embed_tokens.weight[...].astype(dt).T)
        else:
            logits = self.lm_head(x)
        if float32 or config.final_logit_softcapping is not None:
            logits = logits.astype(jnp.float32)
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits
