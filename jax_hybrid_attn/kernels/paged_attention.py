"""Paged attention over query tiles in Pallas Mosaic GPU (flash-decoding when a tile's keys are split).

A query tile is up to ``64 // G`` consecutive query tokens of one request (G = N // K): its 64 wgmma rows
hold the G query heads of one KV head for each token, row ``j * G + g``. One CTA per (tile, KV head,
split). The CTA walks only the blocks between the first key any of its queries may see and the last
(window, chunk or sequence end), split evenly across the splits; TMA streams ``block_kv // S`` pages per
step through a ring of `num_stages` buffers, picked through the block table. Masks are applied only on
steps that straddle an edge, where V rows that no query sees are zeroed first (stale or NaN memory must
not reach ``0 * V``). Each split writes its normalized partial output and log-sum-exp; `tiles.merge_splits`
combines them with the sinks, which enter the denominator only.
"""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._compat import plgpu, resolve_interpret
from ..masks import allowed_key_range, attention_mask

ROWS = 64  # wgmma M: query rows per CTA
LOG2E = math.log2(math.e)
MASKED_LOGIT = -1e30  # finite, so fully masked steps never produce inf - inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """`block_kv` keys per step (whole blocks), `num_stages` TMA buffers, `num_splits` CTAs per tile and head."""

    block_kv: int = 128
    num_stages: int = 2
    num_splits: int = 1

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.num_stages < 1 or self.num_splits < 1:
            raise ValueError(f"num_stages={self.num_stages}, num_splits={self.num_splits} must be >= 1")

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory of the main loop: q tile, K and V rings, the P tile (barriers aside)."""
        return (ROWS * head_dim + 2 * self.num_stages * self.block_kv * head_dim + ROWS * self.block_kv) * itemsize


SMEM_BUDGET_BYTES = 227 * 1024 - 2048  # H100/H200 per-block maximum, less room for barriers


def default_config(head_dim: int, itemsize: int, *, num_splits: int) -> KernelConfig:
    """The measured best on the H200 (benchmarks/RESULTS.md), shrunk until it fits in shared memory."""
    for block_kv, num_stages in ((128, 2), (64, 3), (64, 2), (64, 1)):
        config = KernelConfig(block_kv=block_kv, num_stages=num_stages, num_splits=num_splits)
        if config.smem_bytes(head_dim, itemsize) <= SMEM_BUDGET_BYTES:
            return config
    raise NotImplementedError(f"{head_dim=} does not fit the kernel's shared memory")


def _paged_attention_kernel(
    tile_request_ref, tile_query_start_ref, tile_query_len_ref, seq_lens_ref, query_lens_ref, block_tables_ref,
    q_ref, kv_ref, o_ref, lse_ref,
    *, block_size, group_size, sm_scale, sliding_window, attention_chunk_size, logits_soft_cap, causal,
    kv_layout, config,
):  # fmt: skip
    tile, kv_head, split = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("split")
    request = tile_request_ref[tile]
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    block_kv, num_stages = config.block_kv, config.num_stages
    blocks_per_step = block_kv // block_size
    mask_options = dict(causal=causal, sliding_window=sliding_window, attention_chunk_size=attention_chunk_size)

    seq_len = seq_lens_ref[request]
    query_len = tile_query_len_ref[tile]
    first_q_pos = seq_len - query_lens_ref[request] + tile_query_start_ref[tile]
    last_q_pos = first_q_pos + query_len - 1
    # Keys some query sees: [key_lo, key_hi]; keys every query sees: [all_lo, all_hi].
    key_lo, all_hi = allowed_key_range(first_q_pos, seq_len, **mask_options)
    all_lo, key_hi = allowed_key_range(last_q_pos, seq_len, **mask_options)
    block_lo, block_hi = key_lo // block_size, key_hi // block_size
    step_lo, step_hi = key_lo // block_kv, key_hi // block_kv + 1
    steps_per_split = pl.cdiv(jnp.maximum(step_hi - step_lo, 0), config.num_splits)
    my_lo = jnp.minimum(step_lo + split * steps_per_split, step_hi)
    my_hi = jnp.where(query_len > 0, jnp.minimum(my_lo + steps_per_split, step_hi), my_lo)
    # Steps whose keys every query sees need no mask.
    inner_lo = jnp.clip(pl.cdiv(all_lo, block_kv), my_lo, my_hi)
    inner_hi = jnp.clip((jnp.minimum(all_hi, seq_len - 1) + 1) // block_kv, inner_lo, my_hi)

    def kv_source(page, kv):
        if kv_layout == "NHD":
            return kv_ref.at[page, kv, :, kv_head, :]
        return kv_ref.at[page, kv, kv_head]

    def body(q_smem, k_smem, v_smem, p_smem, k_barriers, v_barriers):
        def issue(step):
            slot = lax.rem(step - my_lo, num_stages)
            for p in range(blocks_per_step):
                block = jnp.clip(step * blocks_per_step + p, block_lo, block_hi)
                page = block_tables_ref[request, block]
                rows = pl.ds(p * block_size, block_size)
                plgpu.copy_gmem_to_smem(kv_source(page, 0), k_smem.at[slot, rows], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(kv_source(page, 1), v_smem.at[slot, rows], v_barriers.at[slot])

        for i in range(num_stages):
            pl.when(my_lo + i < my_hi)(partial(issue, my_lo + i))

        rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
        q_pos = first_q_pos + rows // group_size

        def step_body(step, carry, *, masked):
            acc, m_i, l_i = carry
            slot = lax.rem(step - my_lo, num_stages)
            plgpu.barrier_wait(k_barriers.at[slot])

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            logits = pl.run_scoped(compute_qk, plgpu.ACC((ROWS, block_kv), jnp.float32)) * sm_scale
            if logits_soft_cap is not None:
                logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
            logits = logits * LOG2E
            if masked:
                k_pos = step * block_kv + cols
                logits = jnp.where(attention_mask(q_pos, k_pos, seq_len, **mask_options), logits, MASKED_LOGIT)
            m_new = jnp.maximum(m_i, logits.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_barriers.at[slot])
            if masked:  # zero V rows that no query sees: they may hold stale data or NaN
                v = v_smem[slot]
                v_rows = lax.broadcasted_iota(jnp.int32, v.shape, 0) + step * block_kv
                v_smem[slot] = jnp.where((v_rows >= key_lo) & (v_rows <= key_hi), v, jnp.zeros_like(v))
                plgpu.commit_smem()

            # P goes through shared memory and a fresh accumulator is added in registers: CPU interpret
            # mode runs wgmma only from SMEM operands, and not inside pl.run_state(ACC.init(...)).
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()

            def compute_pv(pv_ref):
                plgpu.wgmma(pv_ref, p_smem, v_smem.at[slot])
                return pv_ref[...]

            acc = acc + pl.run_scoped(compute_pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            pl.when(step + num_stages < my_hi)(partial(issue, step + num_stages))
            return acc, m_new, l_i

        carry = (
            plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), MASKED_LOGIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        carry = lax.fori_loop(my_lo, inner_lo, partial(step_body, masked=True), carry)
        carry = lax.fori_loop(inner_lo, inner_hi, partial(step_body, masked=False), carry)
        return lax.fori_loop(inner_hi, my_hi, partial(step_body, masked=True), carry)

    def with_q(q_smem, q_barrier):
        plgpu.copy_gmem_to_smem(q_ref.at[tile, kv_head], q_smem, q_barrier.at[0])
        plgpu.barrier_wait(q_barrier.at[0])
        transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        acc, m_i, l_i = pl.run_scoped(
            lambda *refs: body(q_smem, *refs),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((ROWS, block_kv), dtype, transforms=transforms),
            plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=num_stages),
        )
        has_keys = l_i > 0
        safe_l = jnp.where(has_keys, l_i, 1.0)
        out = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
        lse = jnp.where(has_keys, (m_i + jnp.log2(safe_l)) / LOG2E, -jnp.inf)

        def write(o_smem, lse_smem):
            o_smem[...] = out
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[tile, kv_head, split])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[tile, kv_head, split])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(write, plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32))

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(with_q, plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms), plgpu.Barrier(num_barriers=1))


def attention_partials(
    q_tiles, kv_cache, tiles, seq_lens, query_lens, block_tables,
    *, block_size, group_size, sm_scale, sliding_window, attention_chunk_size, logits_soft_cap, causal,
    kv_layout, config, interpret,
):  # fmt: skip
    """Run the kernel over query tiles.

    Args:
      q_tiles: [NT, K, 64, H] packed query rows (`tiles.pack_query_rows`).
      tiles: `tiles.QueryTiles` with [NT] request, query start and query length per tile (length 0: idle).
    Returns:
      partial outputs [NT, K, splits, 64, H] (float32, normalized per split) and their log-sum-exp
      [NT, K, splits, 64] (natural log; -inf where a split saw no key).
    """
    num_tiles, num_kv_heads, _, head_dim = q_tiles.shape
    kernel = partial(
        _paged_attention_kernel, block_size=block_size, group_size=group_size, sm_scale=sm_scale,
        sliding_window=sliding_window, attention_chunk_size=attention_chunk_size,
        logits_soft_cap=logits_soft_cap, causal=causal, kv_layout=kv_layout, config=config,
    )  # fmt: skip
    splits = config.num_splits
    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, ROWS, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, ROWS), jnp.float32),
        ),
        grid=(num_tiles, num_kv_heads, splits),
        grid_names=("tile", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=resolve_interpret(interpret),
    )(tiles.request, tiles.query_start, tiles.query_len, seq_lens, query_lens, block_tables, q_tiles, kv_cache)
