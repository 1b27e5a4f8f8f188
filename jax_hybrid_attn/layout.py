"""The KV-cache layouts and storage dtypes, and the shape of one layer's cache.

Layouts (vLLM FlashInfer's names):
  "NHD": [B, 2, S, K, H], the default; zero-copy with vLLM-style torch caches.
  "HND": [B, 2, K, S, H].
Index 0 of axis 1 holds K, index 1 holds V. A float8_e4m3fn cache stores ``value / scale`` with one
scale per tensor (`k_scale`, `v_scale`).
"""

from typing import Literal

import jax.numpy as jnp

from .integers import check_int

__all__ = ["KVLayout", "KV_LAYOUTS", "FP8_DTYPE", "get_kv_cache_shape", "kv_as_nhd"]

KVLayout = Literal["NHD", "HND"]
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


def kv_cache_dims(kv_cache, kv_layout: KVLayout) -> tuple[int, int, int, int]:
    """(B, S, K, H) of a cache in `kv_layout`."""
    num_blocks, _, a, b, head_size = kv_cache.shape
    return (num_blocks, a, b, head_size) if kv_layout == "NHD" else (num_blocks, b, a, head_size)


def kv_as_nhd(kv_cache, kv_layout: KVLayout):
    """The cache as "NHD" [B, 2, S, K, H] (a transpose for "HND")."""
    return kv_cache if kv_layout == "NHD" else jnp.swapaxes(kv_cache, 2, 3)
