"""The public entry point: paged attention on the Mosaic GPU kernels, or the reference.

A mixed batch is split on the device, with no host round trip: requests whose whole query fits one
64-row query tile (``64 // G`` tokens: decodes and short speculative-verification queries) run as decode
tiles, one per request with its keys split across CTAs (flash-decoding) and one consumer warpgroup;
longer queries run as prefill tiles of ``128 // G`` tokens with two consumer warpgroups. Each request is
computed by exactly one of the two launches. A float8_e4m3fn cache's k scale multiplies the logits in
the kernel and its v scale the merged output.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from . import reference
from ._compat import check_interpret_threads, plgpu, resolve_interpret
from .kernels import tiles as query_tiles
from .kernels.paged_attention import attention_partials, default_config
from .layout import KVLayout, kv_cache_dims
from .metadata import AttentionMetadata
from .validation import check_paged_attention_args

__all__ = ["paged_attention", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("kernel", "reference")
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TARGET_DECODE_CTAS = 2 * 132  # two waves of the H200's 132 SMs


def paged_attention(
    q: Float[Array, "T N H"],
    kv_cache: Float[Array, "B 2 S K H"],
    metadata: AttentionMetadata,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, "N"] | None = None,
    causal: bool = True,
    kv_layout: KVLayout = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
    checked: bool = False,
    implementation: str | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "T N H"]:
    """Paged attention with the signature of `reference.paged_attention` (see there for the arguments).

    Args:
      implementation: "kernel" (Mosaic GPU) or "reference"; default: the kernel on a GPU or with
        `interpret`, the reference on a CPU.
      interpret: run the kernel in Mosaic GPU interpret mode (CPU; slow, for tests and notebooks);
        True, or `plgpu.InterpretGPUParams` (e.g. ``detect_races=True``).
    Raises:
      NotImplementedError: the kernel does not support this combination (named in the message).
    """
    if implementation is None:
        implementation = (
            "kernel" if resolve_interpret(interpret) or jax.default_backend() == "gpu" else "reference"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    options = dict(
        sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk_size=attention_chunk_size,
        logits_soft_cap=logits_soft_cap, causal=causal, kv_layout=kv_layout,
    )  # fmt: skip
    if implementation == "reference":
        return reference.paged_attention(
            q, kv_cache, metadata, sinks=sinks, k_scale=k_scale, v_scale=v_scale, checked=checked, **options
        )
    sm_scale, k_scale, v_scale = check_paged_attention_args(
        q, kv_cache, metadata, sinks=sinks, k_scale=k_scale, v_scale=v_scale, checked=checked, **options
    )
    check_kernel_support(q, kv_cache, kv_layout)
    if resolve_interpret(interpret) is not None:
        check_interpret_threads()
    return _paged_attention_kernels(
        q,
        kv_cache,
        metadata,
        sinks,
        k_scale,
        v_scale,
        **{**options, "sm_scale": sm_scale},
        interpret=interpret,
    )


def kernel_configs(head_dim: int, q_dtype, kv_dtype, *, decode_splits: int = 1):
    """The decode (one consumer, split keys) and prefill (two consumers, or one where two do not fit in
    shared memory: head_dim 256 with a float8 cache) kernel configurations."""
    itemsizes = (jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize)
    decode = default_config(head_dim, *itemsizes, num_splits=decode_splits, num_consumers=1)
    try:
        prefill = default_config(head_dim, *itemsizes, num_splits=1, num_consumers=2)
    except NotImplementedError:
        prefill = default_config(head_dim, *itemsizes, num_splits=1, num_consumers=1)
    return decode, prefill


def check_kernel_support(q, kv_cache, kv_layout) -> None:
    """Raise NotImplementedError naming what the kernels cannot do yet."""
    _, block_size, num_kv_heads, head_dim = kv_cache_dims(kv_cache, kv_layout)
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        raise NotImplementedError(f"kernel with q.dtype={q.dtype}: supported are bfloat16 and float16")
    if head_dim % 64:
        raise NotImplementedError(f"kernel with {head_dim=}: must be a multiple of 64")
    for config in kernel_configs(head_dim, q.dtype, kv_cache.dtype):
        if config.block_kv % block_size:
            raise NotImplementedError(f"kernel with {block_size=}: must divide {config.block_kv}")
    if q.shape[1] // num_kv_heads > query_tiles.ROWS:
        raise NotImplementedError(
            f"kernel with {q.shape[1] // num_kv_heads} query heads per KV head: at most 64"
        )


@partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "attention_chunk_size", "logits_soft_cap", "causal",
                     "kv_layout", "interpret"),
)  # fmt: skip
def _paged_attention_kernels(
    q, kv_cache, metadata, sinks, k_scale, v_scale, *, sm_scale, kv_layout, interpret, **options
):
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = kv_cache_dims(kv_cache, kv_layout)
    group_size = num_q_heads // num_kv_heads
    query_lens = metadata.query_lens
    logit_scale = jnp.reshape(sm_scale * k_scale, (1,)).astype(jnp.float32)
    out = jnp.zeros_like(q)

    def run(tiles, config):
        tokens, heads = query_tiles.tile_rows(
            tiles, metadata.query_start_loc, group_size=group_size, num_kv_heads=num_kv_heads,
            num_tokens=num_tokens, rows=config.rows,
        )  # fmt: skip
        partial_out, lse = attention_partials(
            query_tiles.pack_query_rows(q, tokens, heads), kv_cache, tiles, metadata.seq_lens, query_lens,
            metadata.block_tables, logit_scale, block_size=block_size, group_size=group_size, kv_layout=kv_layout,
            config=config, interpret=interpret, **options,
        )  # fmt: skip
        sinks_rows = None if sinks is None else sinks.astype(jnp.float32)[heads]
        return tokens, heads, query_tiles.merge_splits(partial_out, lse, sinks_rows) * v_scale

    decode_splits = max(1, min(16, math.ceil(TARGET_DECODE_CTAS / (metadata.num_reqs * num_kv_heads))))
    decode_config, prefill_config = kernel_configs(
        head_dim, q.dtype, kv_cache.dtype, decode_splits=decode_splits
    )
    tokens, heads, rows = run(query_tiles.decode_tiles(query_lens, group_size), decode_config)
    out = query_tiles.scatter_rows(out, rows, tokens, heads)
    if metadata.max_query_len > query_tiles.tokens_per_tile(group_size):
        tiles = query_tiles.prefill_tiles(query_lens, group_size, num_tokens, rows=prefill_config.rows)
        tokens, heads, rows = run(tiles, prefill_config)
        out = query_tiles.scatter_rows(out, rows, tokens, heads)
    return out
