"""Launching the paged-attention kernel (`paged_attention.paged_attention_cta`) over query tiles.

One CTA per work item (query tile, KV head, split), or a persistent launch of `KernelConfig.persistent_ctas`
CTAs that loop over the work items; each writes its partial outputs and log-sum-exps, which `tiles.token_outputs`
merges per token.
"""

from functools import partial

import jax
import jax.numpy as jnp

from .._compat import plgpu, resolve_interpret
from .config import SMEM_BUDGET_BYTES
from .paged_attention import paged_attention_cta


def attention_partials(
    q_tiles, k_source, v_source, tiles, seq_lens, query_lens, block_tables, logit_scale,
    *, block_size, group_size, params, kv_layout, stacked, config, interpret,
):  # fmt: skip
    """Run the kernel over query tiles for a layer of `params` (its scale is already in `logit_scale`).

    Args:
      q_tiles: [NT, K, rows, H] packed query rows (`tiles.pack_query_rows`), rows = ``config.rows``.
      k_source, v_source: with `stacked`, the one cache [B, 2, ...] twice (K and V are its axis-1 halves); else
        the pair's K and V caches [B, ...].
      tiles: `tiles.QueryTiles` with [NT] request, query start and query length per tile (length 0: idle).
      logit_scale: [1] float32, ``sm_scale * k_scale``.
    Returns:
      partial outputs [NT, K, splits, rows, H] (q's dtype, normalized per split) and their log-sum-exp
      [NT, K, splits, rows] (float32, natural log; -inf where a split saw no key).
    """
    num_tiles, num_kv_heads, _, head_dim = q_tiles.shape
    smem_bytes = config.smem_bytes(head_dim, q_tiles.dtype.itemsize, k_source.dtype.itemsize)
    if smem_bytes > SMEM_BUDGET_BYTES:
        raise NotImplementedError(f"{config} needs {smem_bytes} bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    interpret = resolve_interpret(interpret)
    kernel = partial(
        paged_attention_cta, block_size=block_size, group_size=group_size, params=params, kv_layout=kv_layout,
        stacked=stacked, config=config, p_in_registers=interpret is None,
    )  # fmt: skip
    splits, rows = config.num_splits, config.rows
    num_programs = config.num_programs(num_tiles * num_kv_heads * splits)
    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows, head_dim), q_tiles.dtype),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows), jnp.float32),
        ),
        grid=(num_programs,) if num_programs else (num_tiles, num_kv_heads, splits),
        grid_names=("program",) if num_programs else ("tile", "kv_head", "split"),
        num_threads=config.num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            profile_space=config.profile_ranges,
            profile_dir=config.profile_dir,
            profile_bounds_check=config.profile_ranges > 0,
        ),
        interpret=interpret,
    )(
        tiles.request,
        tiles.query_start,
        tiles.query_len,
        seq_lens,
        query_lens,
        block_tables,
        logit_scale,
        q_tiles,
        k_source,
        v_source,
    )
