"""One layer's paged KV cache as a typed pytree (`KVCache`: its arrays, layout and float8 scales), and its shape.

A layer's cache holds K and V in one array, or in a pair ``(k_cache, v_cache)`` of two arrays of the same shape
and dtype (FlashInfer takes both forms). Layouts (FlashInfer's names):
  "NHD": [B, 2, S, K, H], the default; zero-copy with vLLM-style torch caches. A pair: [B, S, K, H] each.
  "HND": [B, 2, K, S, H]. A pair: [B, K, S, H] each.
  "HND_VT": "HND"'s shape, but V's [S, H] of each block and head holds V transposed, [H, S] row-major (V at
    token s and dimension h sits at ``h * S + s``; `v_transposed` gives the [B, K, H, S] view). The kernels' PV
    product reads V K-major from it, which float8 tensor cores need; S must then be a multiple of
    `V_TRANSPOSED_BLOCK`.
Index 0 of axis 1 holds K, index 1 holds V. The pair is what caches that keep K and V apart hand over without a
copy: vLLM FlashAttention's [2, B, S, K, H] is ``(cache[0], cache[1])``, and transformers' continuous batching
keeps one K and one V tensor per layer. A float8_e4m3fn cache stores ``value / scale`` with one scale per tensor
(`KVCache.k_scale`, `KVCache.v_scale`).

Every function that takes a cache takes a `KVCache`, or, for an "NHD" cache without scales, its array or pair
alone (`as_kv_cache`).
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._compat import register_pytree_dataclass
from .integers import check_int

__all__ = ["KVArrays", "KVCache", "KVLayout", "KV_LAYOUTS", "FP8_DTYPE", "as_kv_cache", "get_kv_cache_shape"]

KVLayout = Literal["NHD", "HND", "HND_VT"]
KVArrays = jax.Array | tuple[jax.Array, jax.Array]
"""One array [B, 2, ...] holding K and V, or the pair ``(k_cache, v_cache)``."""
KV_LAYOUTS: tuple[str, ...] = ("NHD", "HND", "HND_VT")
V_TRANSPOSED_BLOCK = 64
"""An "HND_VT" cache's blocks are a multiple of this many tokens on the kernels: each key step (64 or 128 keys) lies
within one block, whose transposed V is then one swizzled tile."""
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448: writes saturate there rather than turn into NaN
KV_CACHE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, FP8_DTYPE))


def check_kv_layout(kv_layout, *, name: str = "kv_layout") -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{name}={kv_layout!r} must be one of {KV_LAYOUTS}")


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *, kv_layout: KVLayout = "NHD"
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache: [B, 2, S, K, H] for "NHD", [B, 2, K, S, H] for "HND" and "HND_VT"."""
    num_blocks, block_size, num_kv_heads, head_size = (
        check_int(name, value)
        for name, value in dict(
            num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
        ).items()
    )
    check_kv_layout(kv_layout)
    if kv_layout == "NHD":
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
    return (num_blocks, 2, num_kv_heads, block_size, head_size)


def preferred_kv_layout(dtype, block_size: int) -> KVLayout:
    """The layout a serving cache of `dtype` in blocks of `block_size` tokens is kept in (the engine's, the vLLM
    plugin's): "HND_VT" for float8_e4m3fn in blocks of a multiple of `V_TRANSPOSED_BLOCK` (V transposed, which the
    kernels' float8 PV product reads as it is), else "NHD" (vLLM's)."""
    return "HND_VT" if jnp.dtype(dtype) == FP8_DTYPE and block_size % V_TRANSPOSED_BLOCK == 0 else "NHD"


def stored_values(x: jax.Array, scale: Float[Array, ""], dtype) -> jax.Array:
    """What a cache of `dtype` stores for the keys or values `x`: x itself in that dtype, or for float8_e4m3fn
    ``x / scale``, saturated at ±448 (`FP8_MAX`) rather than NaN."""
    if jnp.dtype(dtype) != FP8_DTYPE:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def is_kv_pair(arrays) -> bool:
    """Whether the arrays are a ``(k_cache, v_cache)`` pair rather than one array."""
    return isinstance(arrays, (tuple, list))


@dataclasses.dataclass(frozen=True)
class KVCache:
    """One layer's paged KV cache: its arrays, their layout and a float8 cache's scales (a pytree; the layout is
    static, the scales are traced).

    Attributes:
      data: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND", "HND_VT"), or the pair ``(k_cache, v_cache)`` of
        [B, S, K, H] / [B, K, S, H] each; float32, bfloat16, float16 or float8_e4m3fn.
      layout: "NHD", "HND" or "HND_VT" (V stored transposed within each block and head).
      k_scale, v_scale: a float8_e4m3fn cache's per-tensor scales, numbers or float scalar arrays (it stores
        ``k / k_scale`` and ``v / v_scale``); None is 1. Other dtypes take none: their values are stored as is.
        A jitted function sends a number to the device at each call: keep them as arrays in a serving loop.
    """

    data: KVArrays
    layout: KVLayout = "NHD"
    k_scale: float | Float[Array, ""] | None = None
    v_scale: float | Float[Array, ""] | None = None

    @property
    def is_pair(self) -> bool:
        return is_kv_pair(self.data)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.data[0].dtype if self.is_pair else self.data.dtype)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(B, S, K, H)."""
        if self.is_pair:
            num_blocks, a, b, head_size = self.data[0].shape
        else:
            num_blocks, _, a, b, head_size = self.data.shape
        return (num_blocks, a, b, head_size) if self.layout == "NHD" else (num_blocks, b, a, head_size)

    def halves_nhd(self) -> tuple[jax.Array, jax.Array]:
        """K and V as "NHD" [B, S, K, H] each (slices of one array, or the pair; a transpose for "HND")."""
        k_cache, v_cache = self.data if self.is_pair else (self.data[:, 0], self.data[:, 1])
        if self.layout == "HND":
            return jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2)
        if self.layout == "HND_VT":
            return jnp.swapaxes(k_cache, 1, 2), jnp.moveaxis(v_transposed(v_cache), 3, 1)
        return k_cache, v_cache

    def scales(self) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """(k_scale, v_scale) as float32 scalars, 1 where None. A scale that is not finite and > 0 (a traced one,
        which the entry points cannot check) becomes NaN, so every output it touches is NaN."""

        def resolved(scale):
            if scale is None:
                return jnp.float32(1)
            scale = jnp.asarray(scale, jnp.float32)
            return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, jnp.nan)

        return resolved(self.k_scale), resolved(self.v_scale)

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


register_pytree_dataclass(KVCache, data_fields=["data", "k_scale", "v_scale"], meta_fields=["layout"])


def v_transposed(v_cache: Float[Array, "B K S H"]) -> Float[Array, "B K H S"]:
    """An "HND_VT" cache's V half (or V array of a pair) as what it holds: V transposed per block and head, a
    reshape of the same memory."""
    num_blocks, num_kv_heads, block_size, head_size = v_cache.shape
    return v_cache.reshape(num_blocks, num_kv_heads, head_size, block_size)


def v_untransposed(v_t: Float[Array, "B K H S"]) -> Float[Array, "B K S H"]:
    """`v_transposed`'s inverse: the [B, K, H, S] view back in the array's own shape."""
    num_blocks, num_kv_heads, head_size, block_size = v_t.shape
    return v_t.reshape(num_blocks, num_kv_heads, block_size, head_size)


def as_kv_cache(kv_cache) -> KVCache:
    """`kv_cache` as a `KVCache`: itself, or an array or pair taken as an "NHD" cache without scales."""
    return kv_cache if isinstance(kv_cache, KVCache) else KVCache(kv_cache)


def like_given(updated: KVCache, given) -> "KVCache | KVArrays":
    """The updated cache in the form the caller gave: a `KVCache`, or its arrays alone."""
    return updated if isinstance(given, KVCache) else updated.data
