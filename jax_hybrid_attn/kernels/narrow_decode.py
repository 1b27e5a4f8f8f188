"""Decode attention over a float8 "HND_VT" cache with the keys on the wgmma's 64-row side.

The tile kernel (`paged_attention`) puts query rows on the wgmma's 64-row side, so a decode of G query heads per
KV head fills G of its 64 rows and pays the softmax of all 64. Here the operands swap places, as TensorRT-LLM's
decode kernels do for small head groups ("swap AB"): one CTA per (request, KV head, split), the keys of a step on
the 64-row side and the request's C query columns on the narrow side (C = `columns`: G heads × ``C // G`` tokens,
a multiple of 8; column ``g * (C // G) + j`` is head g, token j):

    scores^T [block_kv, C] = K_step [block_kv, H] · q^T [H, C]
    out^T    [H, C]       += V_step^T [H, block_kv] · P^T [block_kv, C]

Both products run on float8 tensor cores with the K-major operands float8 needs: K's rows as stored, V's block as
"HND_VT" stores it (transposed, [H, S]), and q's and P's float8 parts kept [C, ...] in shared memory. q comes in
its two float8 parts (hi + lo, `float8_query_parts`; scaled by a power of two per request and KV head, which
the CTA's logit scale divides out), and P, scaled by `P_SCALE`, in `KernelConfig.p_parts` parts.
The softmax runs down the keys (the accumulator's rows, reduced across the warpgroup's warps): each step rescales
out^T and an elementwise running sum of P, which is reduced over the keys once, at the end.

The producer warpgroup streams ``block_kv`` keys per step (a part of one block, or several whole blocks, each its
own V^T tile and P^T part) by TMA into a ring of ``KernelConfig.num_stages`` slots, as the tile kernel's does.
Every step is masked (C columns make the mask cheap); on a step holding keys outside the CTA's range V's columns
there are zeroed, since stale or NaN memory must not reach ``0 * V``. Each split writes its normalized output [H, C] and log-sum-exp [C] (`tiles.token_outputs` merges
them with the sinks and the v scale).
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from .._compat import plgpu, resolve_interpret
from ..layout import FP8_DTYPE
from ..masks import attention_mask
from .config import SMEM_BUDGET_BYTES, KernelConfig
from .launch import NO_WINDOW
from .cta_parts import LOG2E, MASKED_LOGIT, P_SCALE, accumulate, smem_transforms, split_key_steps, zero_foreign_columns

COLUMN_MULTIPLE = 8  # wgmma N: the narrow side holds a multiple of 8 columns
MAX_COLUMNS = 64


def narrow_columns(group_size: int, max_query_len: int) -> int | None:
    """The query columns C of a launch whose requests hold at most `max_query_len` tokens of G heads each: G times
    the tokens, rounded up to a multiple of 8; None above `MAX_COLUMNS` (the tile kernel serves those)."""
    columns = -(-group_size * max_query_len // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
    return columns if columns <= MAX_COLUMNS else None


def smem_bytes(config: KernelConfig, head_dim: int, columns: int) -> int:
    """Shared memory of one CTA (float8 K and V rings, q's two parts, P's parts, the output tile; barriers aside)."""
    ring = 2 * config.num_stages * config.block_kv * head_dim
    return ring + 2 * columns * head_dim + config.p_parts * columns * config.block_kv + 4 * columns * (head_dim + 1)


def query_columns(q: Float[Array, "T N H"], query_start: Int[Array, "R"], query_lens: Int[Array, "R"], *,
                  num_kv_heads: int, columns: int) -> Float[Array, "R K C H"]:
    """Each request's query as the kernel's C columns per KV head: column ``g * (C // G) + j`` is head g of
    the request's token j; columns past its `query_lens` tokens, and past G heads, are 0. One gather of whole
    token rows, ``C // G`` per request."""
    num_tokens, num_q_heads, head_dim = q.shape
    group_size = num_q_heads // num_kv_heads
    tokens = columns // group_size
    offsets = jnp.arange(tokens)
    rows = q.at[query_start[:, None] + offsets].get(mode="fill", fill_value=0)  # [R, J, N, H]
    rows = jnp.where((offsets < query_lens[:, None])[..., None, None], rows, 0)
    rows = rows.reshape(-1, tokens, num_kv_heads, group_size, head_dim).transpose(0, 2, 3, 1, 4)
    rows = rows.reshape(-1, num_kv_heads, group_size * tokens, head_dim)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, columns - group_size * tokens), (0, 0)))


def float8_query_parts(
    q_rows: Float[Array, "... C H"], scale: Float[Array, "..."]
) -> Float[Array, "... 2 C H"]:
    """q's columns times `scale` (`mixed_batch.float16_query_scale`, broadcast against them) as two float8
    parts, hi = float8(q) and lo = float8(q - hi), whose sum keeps about bfloat16's precision."""
    scaled = q_rows.astype(jnp.float32) * scale
    high = scaled.astype(FP8_DTYPE)
    low = (scaled - high.astype(jnp.float32)).astype(FP8_DTYPE)
    return jnp.stack([high, low], axis=-3)


def narrow_decode_cta(seq_lens_ref, query_lens_ref, block_tables_ref, logit_scales_ref, window_ref, q_ref,
                      k_ref, v_ref, o_ref, lse_ref, *, block_size, group_size, params, stacked, config,
                      acc_in_registers):  # fmt: skip
    """One CTA: the producer and consumer warpgroups of one (request, KV head, split)."""
    head_dim, columns = q_ref.shape[-1], q_ref.shape[-2]
    tokens = columns // group_size  # column g * tokens + j: head g, token j
    block_kv, num_stages = config.block_kv, config.num_stages
    # A step's keys: one block's part (S >= block_kv) or several whole blocks, each its own V^T tile ("pages")
    page_keys = min(block_size, block_kv)
    pages = block_kv // page_keys
    request, kv_head, split = lax.axis_index("request"), lax.axis_index("kv_head"), lax.axis_index("split")
    mask = dict(params=params, sliding_window=window_ref[0])
    logits_soft_cap = params.logits_soft_cap
    seq_len, query_len = seq_lens_ref[request], query_lens_ref[request]
    first_q_pos = seq_len - query_len
    # Keys some query of the request sees: [key_lo, key_hi]; this split streams its share of the steps holding them
    key_lo, key_hi, my_lo, my_hi = split_key_steps(first_q_pos, query_len, seq_len, split, mask=mask,
                                                   block_kv=block_kv, num_splits=config.num_splits)  # fmt: skip
    block_lo, block_hi = key_lo // block_size, key_hi // block_size

    def ring_slot(step):
        return lax.rem(step - my_lo, num_stages)

    def producer(k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed):
        @pl.loop(my_lo, my_hi)
        def _(step):
            slot = ring_slot(step)
            reused = step - my_lo >= num_stages  # the slot held an earlier step: wait until consumed
            # the step's blocks, read from the block table together; a block past the keys repeats the last one
            ids = [block_tables_ref[request, jnp.clip((step * block_kv + p * page_keys) // block_size, block_lo,
                                                      block_hi)] for p in range(pages)]  # fmt: skip
            rows = pl.ds(lax.rem(step * block_kv, block_size), page_keys)
            pl.when(reused)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
            for p, page in enumerate(ids):  # stacked: one array [B, 2, ...] holds K and V
                block = (page, 0) if stacked else (page,)
                plgpu.copy_gmem_to_smem(k_ref.at[block + (kv_head, rows)],
                                        k_ring.at[slot, pl.ds(p * page_keys, page_keys)], k_loaded.at[slot])
            pl.when(reused)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
            for p, page in enumerate(ids):
                block = (page, 1) if stacked else (page,)
                plgpu.copy_gmem_to_smem(v_ref.at[block + (kv_head, slice(None), rows)], v_ring.at[slot, p],
                                        v_loaded.at[slot])

        # The last steps' consumption, which no later load waited for: every phase of a barrier the producer waits on
        # is observed before the barriers are released (interpret mode checks it)
        @pl.loop(jnp.maximum(my_hi - my_lo - num_stages, 0), my_hi - my_lo)
        def _(position):
            slot = lax.rem(position, num_stages)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])

    def iota(shape, dimension):
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def consumer(q_parts, p_parts, out_smem, lse_smem, k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed,
                 q_loaded):  # fmt: skip
        plgpu.barrier_wait(q_loaded)
        # Logits go to base 2 for exp2; without a soft cap the two scales fold into one multiply.
        logit_scale = logit_scales_ref[request, kv_head]
        if logits_soft_cap is None:
            logit_scale = logit_scale * LOG2E
        score_shape = (block_kv, columns)
        q_pos = first_q_pos + lax.rem(iota(score_shape, 1), tokens)

        def step_body(step, carry):
            acc, m_i, p_sums = carry
            slot = ring_slot(step)
            plgpu.barrier_wait(k_loaded.at[slot])

            def scores_t(acc_ref):
                for part in range(config.q_parts):
                    plgpu.wgmma(acc_ref, k_ring.at[slot], q_parts.at[part].transpose((1, 0)))
                return acc_ref[...]

            scores = pl.run_scoped(scores_t, plgpu.ACC(score_shape, jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            logits = scores * logit_scale
            if logits_soft_cap is not None:
                logits = (logits_soft_cap * LOG2E) * jnp.tanh(logits / logits_soft_cap)
            k_pos = step * block_kv + iota(score_shape, 0)
            logits = jnp.where(attention_mask(q_pos, k_pos, seq_len, **mask), logits, MASKED_LOGIT)
            m_new = jnp.maximum(m_i, logits.max(axis=0))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, score_shape, [1]))
            p_sums = p_sums * lax.broadcast_in_dim(alpha, score_shape, [1]) + p
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            plgpu.barrier_wait(v_loaded.at[slot])
            holds_foreign_keys = (step * block_kv < key_lo) | ((step + 1) * block_kv - 1 > key_hi)

            @pl.when(holds_foreign_keys)
            def _():
                for page in range(pages):
                    zero_foreign_columns(v_ring.at[slot, page], step * block_kv + page * page_keys, key_lo, key_hi)

            acc = accumulate_pv(acc, p, v_ring.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, p_sums

        def accumulate_pv(acc, p, v_t):
            """acc + V^T @ P^T, P's float8 parts stored [C, block_kv] (K-major) in shared memory: through the
            transposed register layout, which a transposed store takes (float8 values cannot shuffle into it)."""
            # times P_SCALE: within float8's range, small probabilities normal (the output divides it out)
            p_t = plgpu.layout_cast(p * P_SCALE, plgpu.Layout.WGMMA_TRANSPOSED)
            for page in range(pages):
                page_p = p_t[page * page_keys : (page + 1) * page_keys] if pages > 1 else p_t
                high = page_p.astype(FP8_DTYPE)
                p_parts.at[0, page].transpose((1, 0))[...] = high
                if config.p_parts == 2:
                    p_parts.at[1, page].transpose((1, 0))[...] = (page_p - high.astype(jnp.float32)).astype(FP8_DTYPE)
            plgpu.commit_smem()

            def issue(acc_ref):
                for page in range(pages):
                    for part in range(config.p_parts):
                        plgpu.wgmma(acc_ref, v_t.at[page], p_parts.at[part, page].transpose((1, 0)))

            return accumulate(acc, issue, in_registers=acc_in_registers)

        carry = (
            plgpu.layout_cast(jnp.zeros((head_dim, columns), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((columns,), MASKED_LOGIT, jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
            plgpu.layout_cast(jnp.zeros(score_shape, jnp.float32), plgpu.Layout.WGMMA),
        )
        acc, m_i, p_sums = lax.fori_loop(my_lo, my_hi, step_body, carry)
        l_i = p_sums.sum(axis=0)
        has_keys = l_i > 0
        out_smem[...] = acc * lax.broadcast_in_dim(1 / (P_SCALE * jnp.where(has_keys, l_i, 1.0)), acc.shape, [1])
        lse_smem[...] = jnp.where(has_keys, (m_i + jnp.log2(jnp.where(has_keys, l_i, 1.0))) / LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[request, kv_head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[request, kv_head, split])
        plgpu.wait_smem_to_gmem(0)

    def body(q_parts, p_parts, out_smem, lse_smem, k_ring, v_ring, q_loaded, k_loaded, v_loaded, k_consumed,
             v_consumed):  # fmt: skip
        ring = (k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed)
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _():
            producer(*ring)

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[request, kv_head], q_parts, q_loaded)
            consumer(q_parts, p_parts, out_smem, lse_smem, *ring, q_loaded)

    key_transforms = smem_transforms(page_keys, FP8_DTYPE)  # V^T pages and P's parts: [.., page_keys], K-major
    head_transforms = smem_transforms(head_dim, FP8_DTYPE)  # K steps and q's parts: [.., H], K-major
    pl.run_scoped(
        body,
        plgpu.SMEM((2, columns, head_dim), FP8_DTYPE, transforms=head_transforms),
        plgpu.SMEM((config.p_parts, pages, columns, page_keys), FP8_DTYPE, transforms=key_transforms),
        plgpu.SMEM((head_dim, columns), jnp.float32),
        plgpu.SMEM((columns,), jnp.float32),
        plgpu.SMEM((num_stages, block_kv, head_dim), FP8_DTYPE, transforms=head_transforms),
        plgpu.SMEM((num_stages, pages, head_dim, page_keys), FP8_DTYPE, transforms=key_transforms),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        collective_axes="wg",
    )


def launch_narrow_decode(
    q_parts, k_source, v_source, query_lens, seq_lens, block_tables, logit_scales, *, block_size, group_size,
    params, stacked, config, interpret,
):  # fmt: skip
    """Run the kernel over (request, KV head, split) for a layer of `params` (its scale is in `logit_scales`).

    Args:
      q_parts: [R, K, 2, C, H] float8: each request's query columns in two float8 parts (`float8_query_parts`).
      k_source, v_source: with `stacked`, the one cache [B, 2, K, S, H] twice; else the pair's K and V caches
        [B, K, S, H]. v_source viewed as [..., K, H, S] (V transposed per block: "HND_VT").
      query_lens, seq_lens: [R]; block_tables: [R, P], every entry a block of the pool.
      logit_scales: [R, K] float32: each CTA's logit scale, ``sm_scale * k_scale`` over the power of two its
        query columns were scaled by before their float8 parts (`mixed_batch.float16_query_scale` per request
        and KV head).
    Returns:
      the partial outputs [R, K, splits, H, C] (float32, normalized per split; transposed) and their log-sum-exps
      [R, K, splits, C] (natural log; -inf where a split saw no key).
    """
    num_reqs, num_kv_heads, _, columns, head_dim = q_parts.shape
    needed = smem_bytes(config, head_dim, columns)
    if needed > SMEM_BUDGET_BYTES:
        raise NotImplementedError(f"{config} needs {needed} bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    if block_size % config.block_kv and config.block_kv % block_size:
        raise ValueError(f"{block_size=} must divide block_kv={config.block_kv} or be a multiple of it")
    interpret = resolve_interpret(interpret)
    window = jnp.full((1,), NO_WINDOW if params.sliding_window is None else params.sliding_window, jnp.int32)
    params = dataclasses.replace(params, sliding_window=None, sm_scale=None)
    kernel = partial(narrow_decode_cta, block_size=block_size, group_size=group_size, params=params, stacked=stacked,
                     config=config, acc_in_registers=interpret is None)  # fmt: skip
    splits = config.num_splits
    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_reqs, num_kv_heads, splits, head_dim, columns), jnp.float32),
            jax.ShapeDtypeStruct((num_reqs, num_kv_heads, splits, columns), jnp.float32),
        ),
        grid=(num_reqs, num_kv_heads, splits),
        grid_names=("request", "kv_head", "split"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(seq_lens, query_lens, block_tables, logit_scales, window, q_parts, k_source, v_source)
