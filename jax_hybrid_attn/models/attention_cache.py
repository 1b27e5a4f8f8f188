"""What a decoder's attention layers read and write, behind one interface.

A model never builds metadata or touches a block table. It calls ``cache.attend(layer, q, k, v, params=...,
sinks=...)`` once per layer and gets the layer's output and the cache to pass on. Two caches implement it:

  * `DenseAttention` (here): one sequence, every token in this call, no cache: plain masked attention in
    float32, the dense forward that the paged path is tested against;
  * `jax_hybrid_attn.engine.paged_cache.PagedCache`: the serving path, where each layer writes its k/v into its
    KV-cache tensor by slot and attends through `layer_attention` (the kernels on a GPU).

Both give each token its position in its sequence (`positions`), which the model's RoPE uses.

Shape letters: T tokens · N query heads · K kv heads · H head size.
"""

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._compat import register_pytree_dataclass
from ..layout import FP8_DTYPE, stored_values
from ..masks import attention_mask
from ..params import LayerAttentionParams, check_params, resolve_sm_scale

__all__ = ["AttentionCache", "DenseAttention", "dense_attention"]


class AttentionCache(Protocol):
    """The attention a decoder's layers call: `positions` of this call's tokens, and `attend` per layer."""

    @property
    def positions(self) -> Int[Array, "T"]: ...

    def at_layer(self, layer: "int | Int[Array, ''] | None") -> "AttentionCache":
        """The cache as layer `layer` sees it: inside a scan over layers the index is traced, and `attend`'s own
        `layer` argument then names only the layer's kind. None: back to `attend`'s argument."""
        ...

    def attend(
        self,
        layer: int,
        q: Float[Array, "T N H"],
        k: Float[Array, "T K H"],
        v: Float[Array, "T K H"],
        *,
        params: LayerAttentionParams,
        sinks: Float[Array, "N"] | None = None,
        k_scale: Float[Array, ""] | None = None,
        v_scale: Float[Array, ""] | None = None,
    ) -> tuple[Float[Array, "T N H"], "AttentionCache"]:
        """Layer `layer`'s attention of this call's queries over its keys (this call's and any cached ones).
        `k_scale`, `v_scale`: the layer's scales for a cache that stores K/V in float8 (others ignore them)."""
        ...


def dense_attention(
    q: Float[Array, "T N H"],
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    *,
    params: LayerAttentionParams,
    sinks: Float[Array, "N"] | None = None,
) -> Float[Array, "T N H"]:
    """Attention of one sequence of T tokens at positions 0..T-1 over its own keys, in float32 (q's dtype out).

    The masks are `jax_hybrid_attn.masks.attention_mask` (causality, window, chunk); the soft cap applies before
    masking; a sink adds ``exp(sink)`` to the softmax denominator of its query head."""
    check_params(params)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    positions = jnp.arange(num_tokens)
    allowed = attention_mask(positions[:, None], positions[None, :], num_tokens, params=params)  # [T, T]
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    logits = jnp.einsum("tkgh,skh->kgts", qf, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    logits = logits * resolve_sm_scale(params.sm_scale, head_dim)
    if params.logits_soft_cap is not None:
        logits = params.logits_soft_cap * jnp.tanh(logits / params.logits_soft_cap)
    logits = jnp.where(allowed, logits, -jnp.inf)
    if sinks is not None:  # one more logit per query head, in the denominator only
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1, 1), (*logits.shape[:3], 1))
        weights = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("kgts,skh->tkgh", weights, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """One sequence, all of its tokens in one call, nothing cached: `attend` is `dense_attention`.

    Attributes:
      num_tokens: T, the sequence's length (static).
      kv_dtype: None, or float8_e4m3fn: each layer's k and v pass through what a float8 cache stores and reads
        back (divided by the layer's scales, rounded and saturated, multiplied back) before attending, so that
        the dense forward gives what a paged float8 cache computes (static).
    """

    num_tokens: int
    kv_dtype: object = None

    @property
    def positions(self) -> Int[Array, "T"]:
        return jnp.arange(self.num_tokens, dtype=jnp.int32)

    def at_layer(self, layer):
        del layer  # every layer sees the same sequence
        return self

    def attend(self, layer, q, k, v, *, params, sinks=None, k_scale=None, v_scale=None):
        del layer  # nothing is cached
        if self.kv_dtype is not None:
            k, v = (_stored_and_read(x, scale, self.kv_dtype) for x, scale in ((k, k_scale), (v, v_scale)))
        return dense_attention(q, k, v, params=params, sinks=sinks), self


def _stored_and_read(x, scale, kv_dtype):
    """`x` as a `kv_dtype` cache stores it (`layout.stored_values`) and the attention reads it back."""
    if jnp.dtype(kv_dtype) != FP8_DTYPE:
        raise NotImplementedError(f"DenseAttention with kv_dtype={kv_dtype}: only {FP8_DTYPE} is modelled")
    scale = jnp.float32(1) if scale is None else scale
    # The barrier keeps the float8 values: XLA's GPU compiler drops a convert pair (f32 -> float8 -> f32) as excess
    # precision, which would leave the cache's rounding out.
    stored = jax.lax.optimization_barrier(stored_values(x, scale, FP8_DTYPE))
    return (stored.astype(jnp.float32) * scale).astype(x.dtype)


register_pytree_dataclass(DenseAttention, data_fields=[], meta_fields=["num_tokens", "kv_dtype"])
