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
from .layout import FP8_DTYPE, KVLayout, check_kv_layout, kv_cache_dtype
from .metadata import AttentionMetadata
from .params import CAUSAL, LayerAttentionParams
from .validation import resolve_kv_scales

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
    """The partition of a [B, 2, S, K, H] (NHD) or [B, 2, K, S, H] (HND) cache split by KV heads over `axis`."""
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
    kv_cache: Float[Array, "B 2 S K H"],
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    kv_layout: KVLayout = "NHD",
    k_scale: float | Float[Array, ""] | None = None,
    v_scale: float | Float[Array, ""] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T N H"], Float[Array, "B 2 S K H"]]:
    """`layer_attention` with the heads split over the mesh axis `axis` (through `jax.shard_map`).

    q's N query heads, k/v's and the cache's K KV heads (already `replicate_kv_heads`-ed when K < devices) are
    split in order over the axis; the metadata and a float8 cache's `k_scale` / `v_scale` are the same on every
    device. Returns (output [T, N, H], the updated cache), split the same way."""
    check_kv_layout(kv_layout)
    num_devices = mesh.shape[axis]
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_q_heads % num_devices or num_kv_heads % num_devices:
        raise ValueError(
            f"{num_q_heads=} and {num_kv_heads=} must divide over {num_devices} devices (replicate_kv_heads first)"
        )
    heads = P(None, axis, None)
    cache_spec = kv_cache_spec(axis, kv_layout)

    float8 = kv_cache_dtype(kv_cache) == FP8_DTYPE
    scales = resolve_kv_scales(kv_cache_dtype(kv_cache), k_scale, v_scale)  # checked here: traced per device

    def per_device(q, k, v, kv_cache, metadata, sinks, k_scale, v_scale):
        return layer_attention(
            q, k, v, kv_cache, metadata, params=params, sinks=sinks, kv_layout=kv_layout,
            k_scale=k_scale if float8 else None, v_scale=v_scale if float8 else None,
            implementation=implementation, interpret=interpret,
        )  # fmt: skip

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(heads, heads, heads, cache_spec, P(), None if sinks is None else P(axis), P(), P()),
        out_specs=(heads, cache_spec),
        check_vma=False,
    )(q, k, v, kv_cache, metadata, sinks, *scales)
