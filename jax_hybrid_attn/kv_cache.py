"""Writing a step's K/V into the paged cache by slot (vLLM's `reshape_and_cache_flash`)."""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .layout import KVArrays, KVCache, like_given, stored_values, v_transposed, v_untransposed
from .validation import check_write_kv_args

__all__ = ["write_kv"]


def write_kv_traced(kv_cache: KVCache, k: Float[Array, "T K H"], v: Float[Array, "T K H"],
                    slot_mapping: Int[Array, "T"]) -> KVCache:  # fmt: skip
    """`write_kv`'s work, unchecked and traceable: the updated cache."""
    num_blocks, block_size, _, _ = kv_cache.dims
    # PAD_SLOT_ID (and, unchecked, any slot outside the cache) goes to block B, which mode="drop" discards.
    in_cache = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    block = jnp.where(in_cache, slot_mapping // block_size, num_blocks)
    offset = jnp.where(in_cache, slot_mapping % block_size, 0)
    k_scale, v_scale = kv_cache.scales()
    k = stored_values(k, k_scale, kv_cache.dtype)
    v = stored_values(v, v_scale, kv_cache.dtype)
    # Each index form selects [T, K, H]: advanced indices come first when a slice separates them. The updates
    # scatter into the arrays as they are (never halves stacked again: the cache is updated in place).
    layout = kv_cache.layout
    if kv_cache.is_pair:
        k_cache, v_cache = kv_cache.data
        if layout == "NHD":
            data = k_cache.at[block, offset].set(k, mode="drop"), v_cache.at[block, offset].set(v, mode="drop")
        elif layout == "HND":
            data = k_cache.at[block, :, offset].set(k, mode="drop"), v_cache.at[block, :, offset].set(v, mode="drop")
        else:  # "HND_VT": V's [H, S] per block and head takes the token as a column
            v_cache = v_untransposed(v_transposed(v_cache).at[block, :, :, offset].set(v, mode="drop"))
            data = k_cache.at[block, :, offset].set(k, mode="drop"), v_cache
    elif layout == "NHD":  # K and V of a token in one scatter: [T, 2, K, H]
        data = kv_cache.data.at[block, :, offset].set(jnp.stack([k, v], axis=1), mode="drop")
    elif layout == "HND":
        data = kv_cache.data.at[block, :, :, offset].set(jnp.stack([k, v], axis=1), mode="drop")
    else:
        data = kv_cache.data.at[block, 0, :, offset].set(k, mode="drop")
        shape = data.shape  # [B, 2, K, S, H] viewed as [B, 2, K, H, S] for V's columns
        columns = data.reshape(*shape[:3], shape[4], shape[3])
        data = columns.at[block, 1, :, :, offset].set(v, mode="drop").reshape(shape)
    return kv_cache.replace(data=data)


@partial(jax.jit, donate_argnames=("data",))
def _write_kv(data, kv_cache, k, v, slot_mapping):
    return write_kv_traced(kv_cache.replace(data=data), k, v, slot_mapping).data


def write_kv(
    kv_cache: KVCache | KVArrays,
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    slot_mapping: Int[Array, "T"],
    *,
    checked: bool = False,
) -> KVCache | KVArrays:
    """Write each token's K/V to its slot and return the updated cache, in the form given.

    The cache's arrays are donated (both of a pair): their buffers are updated in place and must not be used
    afterwards; its scales are not. Tokens whose slot is `PAD_SLOT_ID` are dropped; every slot that no token names
    stays bit-identical. A float8_e4m3fn cache stores ``k / k_scale`` and ``v / v_scale``, saturated at ±448.

    Args:
      kv_cache: a `KVCache` (arrays [B, 2, S, K, H] "NHD" or [B, 2, K, S, H] "HND" / "HND_VT", or the pair of
        [B, S, K, H] / [B, K, S, H]; scales), or an "NHD" cache's array or pair alone.
      k, v: [T, K, H] this step's keys and values.
      slot_mapping: [T] int32, ``block_id * S + offset``, or `PAD_SLOT_ID`.
      checked: also check that every slot lies in the cache or is `PAD_SLOT_ID`, that none is in the null block
        (`NULL_BLOCK_ID`) and that no slot is named twice (needs concrete values; unchecked, a slot outside the
        cache is dropped, and one in the null block is written).
    """
    cache = check_write_kv_args(kv_cache, k, v, slot_mapping, checked=checked)
    data = _write_kv(cache.data, cache.replace(data=None), k, v, slot_mapping)
    return like_given(cache.replace(data=data), kv_cache)
