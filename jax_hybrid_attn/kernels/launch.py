"""Launching the paged-attention kernel (`paged_attention.paged_attention_cta`) over query tiles.

One CTA per work item (query tile, KV head, split). A launch with one split reads q and writes its output in
[T, N, H] itself where the group size allows (`direct_io_supported`); else its tiles get packed query rows and
write partial outputs and log-sum-exps, which `tiles.token_outputs` (decode tiles) or `tiles.prefill_token_rows`
merge per token.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from .._compat import plgpu, resolve_interpret, share_identical_kernels
from .config import PROFILE_RANGES, SMEM_BUDGET_BYTES
from .paged_attention import paged_attention_cta

share_identical_kernels()  # the step shapes' equal kernels compile once

NO_WINDOW = 2**31 - 1
"""The window a layer without one passes (int32's largest): it allows every key before any int32 position."""


def launch_attention(
    q_source, k_source, v_source, tiles, query_start_loc, query_lens, seq_lens, block_tables, request_flags,
    num_actual_tokens, scales, sinks, *, block_size, group_size, num_kv_heads, params, kv_layout, stacked, direct,
    compute_dtype, config, interpret,
):  # fmt: skip
    """Run the kernel over query tiles for a layer of `params` (its scale is already in `scales`).

    Args:
      q_source: [NT, K, rows, H] packed query rows (`tiles.pack_query_rows`) in `compute_dtype`, rows =
        ``config.rows``; with `direct`, q itself [T, N, H] (the kernel scales and converts it).
      k_source, v_source: with `stacked`, the one cache [B, 2, ...] twice (K and V are its axis-1 halves); else
        the pair's K and V caches [B, ...]. For `kv_layout` "HND_VT", v_source is viewed as [..., K, H, S].
      tiles: `tiles.QueryTiles` with [NT] request, query start and query length per tile (length 0: idle).
      query_start_loc, query_lens, seq_lens, block_tables, request_flags: the fields of `tiles.Requests`, the
        flags used with `direct` only.
      num_actual_tokens: [] int32, the first padding token (its output and the later ones 0; with `direct`).
      scales: [3] float32: the logit scale (``sm_scale * k_scale`` over q's scale), the v scale (applied by the
        kernel with `direct` only) and q's scale (`mixed_batch.float16_query_scale`, or 1).
      compute_dtype: the wgmma operands' dtype (q's, or float16 for a bfloat16 q and a float8 cache).
      sinks: [N] float32 or None; used with `direct` only (else `tiles.merge_splits` adds them).
      direct: each CTA reads its query rows from q and writes its output rows into [T, N, H] (one split,
        `direct_io_supported`).
    Returns:
      with `direct`, the output [T, N, H] (q's dtype; rows of tokens no tile holds are left unwritten: with
      `launch_plan.with_tokens_after_the_requests`, those of decode tiles only). Else the
      partial outputs [NT, K, splits, rows, H] (`compute_dtype`, normalized per split) and their log-sum-exp
      [NT, K, splits, rows] (float32, natural log; -inf where a split saw no key).
    """
    num_tiles, head_dim = tiles.request.shape[0], q_source.shape[-1]
    smem_bytes = config.smem_bytes(head_dim, q_source.dtype.itemsize, k_source.dtype.itemsize, direct=direct,
                                   v_transposed=kv_layout == "HND_VT")  # fmt: skip
    if smem_bytes > SMEM_BUDGET_BYTES:
        raise NotImplementedError(f"{config} needs {smem_bytes} bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    if direct and (config.num_splits != 1 or not direct_io_supported(group_size)):
        raise ValueError(f"direct query and output rows need one split and G in (1, 2, 4, 8): {config} {group_size=}")
    interpret = resolve_interpret(interpret)
    # The window goes in as data and the scale is in `scales`: layers that differ only in those share a kernel.
    window = jnp.full((1,), NO_WINDOW if params.sliding_window is None else params.sliding_window, jnp.int32)
    params = dataclasses.replace(params, sliding_window=None, sm_scale=None)
    kernel = partial(
        paged_attention_cta, block_size=block_size, group_size=group_size, num_kv_heads=num_kv_heads, params=params,
        kv_layout=kv_layout, stacked=stacked, direct=direct, has_sinks=sinks is not None,
        compute_dtype=jnp.dtype(compute_dtype), config=config,
        p_in_registers=interpret is None,
    )  # fmt: skip
    splits, rows = config.num_splits, config.rows
    if direct:
        out_type = jax.ShapeDtypeStruct(q_source.shape, q_source.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows, head_dim), q_source.dtype),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows), jnp.float32),
        )
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "kv_head", "split"),
        num_threads=config.num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            profile_space=PROFILE_RANGES if config.profile_dir else 0,
            profile_dir=config.profile_dir,
            profile_bounds_check=bool(config.profile_dir),
        ),
        interpret=interpret,
    )(
        tiles.request,
        tiles.query_start,
        tiles.query_len,
        seq_lens,
        query_lens,
        block_tables,
        query_start_loc,
        request_flags.astype(jnp.int32),
        jnp.reshape(num_actual_tokens, (1,)).astype(jnp.int32),
        scales,
        window,
        jnp.zeros((1,), jnp.float32) if sinks is None else sinks,
        q_source,
        k_source,
        v_source,
    )


def direct_io_supported(group_size: int) -> bool:
    """Whether the kernel can read q and write the output in [T, N, H] itself: each of the G heads then owns
    ``64 // G`` consecutive rows of a warpgroup's 64, copied in power-of-two pieces (G = 1, 2, 4, 8)."""
    return group_size in (1, 2, 4, 8)
