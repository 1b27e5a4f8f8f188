"""Writing a step's K/V into the paged cache by slot (vLLM's `reshape_and_cache_flash`)."""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .layout import FP8_DTYPE, FP8_MAX, KVCache, KVLayout, is_kv_pair, kv_cache_dims, kv_cache_dtype
from .validation import check_write_kv_args

__all__ = ["write_kv"]


def _quantize(x, scale, dtype):
    if dtype != FP8_DTYPE:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


@partial(jax.jit, static_argnames=("kv_layout",), donate_argnames=("kv_cache",))
def _write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, *, kv_layout):
    num_blocks, block_size, _, _ = kv_cache_dims(kv_cache, kv_layout)
    # PAD_SLOT_ID (and, unchecked, any slot outside the cache) goes to block B, which mode="drop" discards.
    in_cache = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    block = jnp.where(in_cache, slot_mapping // block_size, num_blocks)
    offset = jnp.where(in_cache, slot_mapping % block_size, 0)
    dtype = kv_cache_dtype(kv_cache)
    k = _quantize(k, k_scale, dtype)
    v = _quantize(v, v_scale, dtype)
    # Each index form selects [T, K, H]: advanced indices come first when a slice separates them.
    if is_kv_pair(kv_cache):
        k_cache, v_cache = kv_cache
        if kv_layout == "NHD":
            return k_cache.at[block, offset].set(k, mode="drop"), v_cache.at[block, offset].set(v, mode="drop")
        return k_cache.at[block, :, offset].set(k, mode="drop"), v_cache.at[block, :, offset].set(v, mode="drop")
    if kv_layout == "NHD":
        kv_cache = kv_cache.at[block, 0, offset].set(k, mode="drop")
        return kv_cache.at[block, 1, offset].set(v, mode="drop")
    kv_cache = kv_cache.at[block, 0, :, offset].set(k, mode="drop")
    return kv_cache.at[block, 1, :, offset].set(v, mode="drop")


def write_kv(
    kv_cache: KVCache,
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    slot_mapping: Int[Array, "T"],
    *,
    kv_layout: KVLayout = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
    checked: bool = False,
) -> KVCache:
    """Write each token's K/V to its slot and return the updated cache.

    `kv_cache` is donated (both arrays of a pair): its buffer is updated in place and must not be used afterwards. Tokens whose
    slot is `PAD_SLOT_ID` are dropped; every slot that no token names stays bit-identical. A float8_e4m3fn
    cache stores ``k / k_scale`` and ``v / v_scale``, saturated at ±448 (scales default to 1).

    Args:
      kv_cache: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND"), or the pair ``(k_cache, v_cache)`` of
        [B, S, K, H] / [B, K, S, H] each (`layout`).
      k, v: [T, K, H] this step's keys and values.
      slot_mapping: [T] int32, ``block_id * S + offset``, or `PAD_SLOT_ID`.
      checked: also check that every slot lies in the cache or is `PAD_SLOT_ID`, that none is in the null block
        (`NULL_BLOCK_ID`) and that no slot is named twice (needs concrete values; unchecked, a slot outside the
        cache is dropped, and one in the null block is written).
    """
    k_scale, v_scale = check_write_kv_args(
        kv_cache, k, v, slot_mapping, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale, checked=checked
    )
    return _write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, kv_layout=kv_layout)
