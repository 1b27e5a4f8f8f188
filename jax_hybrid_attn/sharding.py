"""Attention over a mesh axis of devices (tensor parallelism): query and KV heads split across the axis, each
device attending its own heads over its slice of every block. Block ids are the same everywhere: the metadata
(the allocator's, replicated) is one for all devices.

GQA keeps each device's query heads with the KV heads they read when the heads are split in order. With fewer
KV heads than devices, the cache holds each KV head ``devices / K`` times (`replicate_kv_heads`), so that every
device still holds a whole KV head for its query heads.

Shape letters: T tokens · N query heads · K kv heads · H head size · B blocks · S block size.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .attention import layer_attention
from .integers import check_int
from .layout import KVCache, KVLayout, check_kv_layout, like_given
from .metadata import AttentionMetadata
from .params import CAUSAL, LayerAttentionParams
from .validation import check_kv_cache

__all__ = [
    "TENSOR_AXIS",
    "kv_cache_spec",
    "kv_heads_per_device",
    "replicate_kv_heads",
    "sharded_layer_attention",
    "tensor_parallel_mesh",
]

TENSOR_AXIS = "tensor"
"""The mesh axis of `tensor_parallel_mesh` (the serving engine splits heads over it)."""


def tensor_parallel_mesh(num_devices: int) -> Mesh | None:
    """A one-axis mesh (`TENSOR_AXIS`) of the first `num_devices` of `jax.devices()`; None for one device."""
    check_int("num_devices", num_devices)
    if num_devices == 1:
        return None
    devices = jax.devices()
    if num_devices > len(devices):
        raise ValueError(f"tensor_parallel={num_devices} exceeds the {len(devices)} devices ({devices[0].platform})")
    return Mesh(np.array(devices[:num_devices]), (TENSOR_AXIS,))


def kv_cache_spec(axis: str, kv_layout: KVLayout = "NHD") -> P:
    """The partition of a [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND", "HND_VT") cache split by KV heads
    over `axis`."""
    check_kv_layout(kv_layout)
    return P(None, None, None, axis, None) if kv_layout == "NHD" else P(None, None, axis, None, None)


def kv_heads_per_device(num_kv_heads: int, num_devices: int) -> int:
    """KV heads each device holds: ``K / devices``, or 1 when K < devices (heads replicated)."""
    check_int("num_kv_heads", num_kv_heads)
    check_int("num_devices", num_devices)
    if num_kv_heads % num_devices and num_devices % num_kv_heads:
        raise ValueError(f"{num_kv_heads=} and {num_devices=}: one must divide the other")
    return max(num_kv_heads // num_devices, 1)


def replicate_kv_heads(x: Array, *, num_devices: int, axis: int) -> Array:
    """`x` with each KV head (on `axis`) repeated ``devices / K`` times when K < devices; else `x` itself."""
    num_kv_heads = x.shape[axis]
    kv_heads_per_device(num_kv_heads, num_devices)
    return x if num_kv_heads >= num_devices else jnp.repeat(x, num_devices // num_kv_heads, axis=axis)


def sharded_layer_attention(
    mesh: Mesh,
    axis: str,
    q: Float[Array, "T N H"],
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    kv_cache: KVCache | Float[Array, "B 2 S K H"],
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T N H"], KVCache | Float[Array, "B 2 S K H"]]:
    """`layer_attention` with the heads split over the mesh axis `axis` (through `jax.shard_map`).

    q's N query heads, k/v's and the cache's K KV heads (already `replicate_kv_heads`-ed when K < devices) are
    split in order over the axis; the metadata and a float8 cache's scales are the same on every device. The
    cache is a `KVCache` holding one array (not a pair), or that "NHD" array alone. Returns (output [T, N, H], the
    updated cache in the form given), split the same way."""
    cache = check_kv_cache(kv_cache)  # checked here: the scales are traced per device
    if cache.is_pair:
        raise NotImplementedError("sharded_layer_attention with a (k_cache, v_cache) pair: pass one [B, 2, ...] array")
    num_devices = mesh.shape[axis]
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_q_heads % num_devices or num_kv_heads % num_devices:
        raise ValueError(
            f"{num_q_heads=} and {num_kv_heads=} must divide over {num_devices} devices (replicate_kv_heads first)"
        )
    heads = P(None, axis, None)

    def replicated(scale):
        return None if scale is None else P()

    cache_spec = cache.replace(
        data=kv_cache_spec(axis, cache.layout), k_scale=replicated(cache.k_scale), v_scale=replicated(cache.v_scale)
    )

    def per_device(q, k, v, kv_cache, metadata, sinks):
        return layer_attention(q, k, v, kv_cache, metadata, params=params, sinks=sinks,
                               implementation=implementation, interpret=interpret)  # fmt: skip

    out, cache = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(heads, heads, heads, cache_spec, P(), None if sinks is None else P(axis)),
        out_specs=(heads, cache_spec),
        check_vma=False,
    )(q, k, v, cache, metadata, sinks)
    return out, like_given(cache, kv_cache)
