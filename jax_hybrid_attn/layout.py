"""The KV-cache layouts and storage dtypes, and the shape of one layer's cache.

A layer's cache is one array that holds K and V, or a pair ``(k_cache, v_cache)`` of two arrays of the same
shape and dtype (FlashInfer takes both forms). Layouts (FlashInfer's names):
  "NHD": [B, 2, S, K, H], the default; zero-copy with vLLM-style torch caches. A pair: [B, S, K, H] each.
  "HND": [B, 2, K, S, H]. A pair: [B, K, S, H] each.
Index 0 of axis 1 holds K, index 1 holds V. The pair is what caches that keep K and V apart hand over without a
copy: vLLM FlashAttention's [2, B, S, K, H] is ``(cache[0], cache[1])``, and transformers' continuous batching
keeps one K and one V tensor per layer. A float8_e4m3fn cache stores ``value / scale`` with one scale per tensor
(`k_scale`, `v_scale`).
"""

from typing import Literal

import jax
import jax.numpy as jnp

from .integers import check_int

__all__ = [
    "KVCache", "KVLayout", "KV_LAYOUTS", "FP8_DTYPE", "get_kv_cache_shape", "is_kv_pair", "kv_as_nhd", "kv_halves_nhd",
]  # fmt: skip

KVLayout = Literal["NHD", "HND"]
KVCache = jax.Array | tuple[jax.Array, jax.Array]
"""One array [B, 2, ...] holding K and V, or the pair ``(k_cache, v_cache)``."""
KV_LAYOUTS: tuple[str, ...] = ("NHD", "HND")
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448: writes saturate there rather than turn into NaN
KV_CACHE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, FP8_DTYPE))


def check_kv_layout(kv_layout) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} must be one of {KV_LAYOUTS}")


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *, kv_layout: KVLayout = "NHD"
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache: [B, 2, S, K, H] for "NHD", [B, 2, K, S, H] for "HND"."""
    for name, value in dict(
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    ).items():
        check_int(name, value)
    check_kv_layout(kv_layout)
    if kv_layout == "NHD":
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
    return (num_blocks, 2, num_kv_heads, block_size, head_size)


def is_kv_pair(kv_cache) -> bool:
    """Whether the cache is a ``(k_cache, v_cache)`` pair rather than one array."""
    return isinstance(kv_cache, (tuple, list))


def kv_cache_dims(kv_cache: KVCache, kv_layout: KVLayout) -> tuple[int, int, int, int]:
    """(B, S, K, H) of a cache in `kv_layout`."""
    if is_kv_pair(kv_cache):
        num_blocks, a, b, head_size = kv_cache[0].shape
    else:
        num_blocks, _, a, b, head_size = kv_cache.shape
    return (num_blocks, a, b, head_size) if kv_layout == "NHD" else (num_blocks, b, a, head_size)


def kv_cache_dtype(kv_cache: KVCache) -> jnp.dtype:
    return jnp.dtype(kv_cache[0].dtype if is_kv_pair(kv_cache) else kv_cache.dtype)


def kv_as_nhd(kv_cache, kv_layout: KVLayout):
    """One array [B, 2, ...] as "NHD" [B, 2, S, K, H] (a transpose for "HND")."""
    return kv_cache if kv_layout == "NHD" else jnp.swapaxes(kv_cache, 2, 3)


def kv_halves_nhd(kv_cache: KVCache, kv_layout: KVLayout) -> tuple[jax.Array, jax.Array]:
    """K and V as "NHD" [B, S, K, H] each (slices of one array, or the pair; a transpose for "HND")."""
    k_cache, v_cache = kv_cache if is_kv_pair(kv_cache) else (kv_cache[:, 0], kv_cache[:, 1])
    if kv_layout == "HND":
        return jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2)
    return k_cache, v_cache
