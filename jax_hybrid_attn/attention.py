"""Attention for one layer of one step: `paged_attention` (the kernels or the reference) and `layer_attention`
(write the step's K/V into the cache by slot, then attend).

One serving step, per KV-cache group and layer::

    state, out = allocator.allocate_slots(config, state, ...)          # blocks for the step's tokens
    metadata = metadata_from_step(config, out, group)                   # per KV-cache group, traced
    y, kv_cache = layer_attention(q, k, v, kv_cache, metadata, params=layer_params)   # per layer

Everything after the allocator is traceable: the metadata and every layer run inside the model's jit.
"""

from functools import partial

import jax
from jaxtyping import Array, Float

from . import reference
from ._compat import plgpu, resolve_interpret
from .cascade import cascade_attention
from .kernels.mixed_batch import paged_attention_kernels
from .kv_cache import write_kv_traced
from .layout import KVArrays, KVCache, like_given
from .metadata import AttentionMetadata
from .params import CAUSAL, LayerAttentionParams
from .validation import IMPLEMENTATIONS, check_paged_attention_args, check_write_kv_args, resolve_implementation

__all__ = ["IMPLEMENTATIONS", "layer_attention", "paged_attention"]


def paged_attention(
    q: Float[Array, "T N H"],
    kv_cache: KVCache | KVArrays,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    checked: bool = False,
    implementation: str | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "T N H"]:
    """Paged attention with the arguments of `reference.paged_attention` (see there), on the kernels or the reference.

    Args:
      implementation: "kernel" (Mosaic GPU) or "reference"; default: the kernels on a GPU or with `interpret`,
        the reference on a CPU.
      interpret: run the kernels in Mosaic GPU interpret mode (CPU; slow, for tests and notebooks);
        True, or `plgpu.InterpretGPUParams` (e.g. ``detect_races=True``); never with the reference.
    Raises:
      NotImplementedError: the kernels do not support this combination (named in the message).
    """
    options = dict(params=params, sinks=sinks, checked=checked)
    if isinstance(metadata, AttentionMetadata) and metadata.num_common_prefix_blocks is not None:
        return cascade_attention(q, kv_cache, metadata, num_common_prefix_blocks=metadata.num_common_prefix_blocks,
                                 implementation=implementation, interpret=interpret, **options)  # fmt: skip
    if resolve_implementation(implementation, interpret) == "reference":
        return reference.paged_attention(q, kv_cache, metadata, **options)
    return paged_attention_kernels(q, kv_cache, metadata, interpret=interpret, **options)


def layer_attention(
    q: Float[Array, "T N H"],
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    kv_cache: KVCache | KVArrays,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    implementation: str | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[Float[Array, "T N H"], KVCache | KVArrays]:
    """One layer of one step: write the step's k/v into the cache at ``metadata.slot_mapping``, then attend.

    The cache's arrays are donated (updated in place; do not use them afterwards), its scales are not. Inside a
    jit, call it as any other function; the static options are `params`, the cache's layout and `implementation`.

    Args:
      q: [T, N, H] this step's queries; k, v: [T, K, H] its keys and values (or both None: the layer reads a
        cache another layer wrote, nothing is written).
      kv_cache: a `KVCache` (arrays, layout, float8 scales) or an "NHD" cache's array or pair, as
        `paged_attention`.
      metadata: the step's metadata of the layer's KV-cache group (`metadata_from_step`).
      params, sinks, implementation, interpret: as `paged_attention`.
    Returns:
      (attention output [T, N, H] in q's dtype, the updated cache in the form given).
    """
    # The attention's checks first: the write below would otherwise report the metadata's errors as its own
    params, cache = check_paged_attention_args(q, kv_cache, metadata, params=params, sinks=sinks, checked=False)
    if (k is None) != (v is None):
        raise ValueError("k and v must both be given, or both be None (a layer that reads another layer's cache)")
    if k is not None:
        check_write_kv_args(cache, k, v, metadata.slot_mapping, checked=False)
    implementation = resolve_implementation(implementation, interpret)
    out, data = _layer_attention(
        q, k, v, cache.data, cache.replace(data=None), metadata, sinks,
        params=params, implementation=implementation, interpret=interpret,
    )  # fmt: skip
    return out, like_given(cache.replace(data=data), kv_cache)


@partial(jax.jit, static_argnames=("params", "implementation", "interpret"), donate_argnames=("data",))
def _layer_attention(q, k, v, data, kv_cache, metadata, sinks, *, params, implementation, interpret):
    kv_cache = kv_cache.replace(data=data)
    if k is not None:
        kv_cache = write_kv_traced(kv_cache, k, v, metadata.slot_mapping)
    out = paged_attention(
        q, kv_cache, metadata, params=params, sinks=sinks, implementation=implementation, interpret=interpret
    )
    return out, kv_cache.data
