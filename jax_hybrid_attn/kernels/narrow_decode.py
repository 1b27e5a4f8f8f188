"""Decode attention over a float8 "HND_VT" cache with the keys on the wgmma's 64-row side.

The tile kernel (`paged_attention`) puts query rows on the wgmma's 64-row side, so a decode of G query heads per
KV head fills G of its 64 rows and pays the softmax of all 64. Here the operands swap places, as TensorRT-LLM's
decode kernels do for small head groups ("swap AB"): one CTA per (request, KV head, split), the keys of a step on
the 64-row side and the request's C query columns on the narrow side (C = `columns`: G heads × ``C // G`` tokens,
a multiple of 8; column ``g * (C // G) + j`` is head g, token j):

    scores^T [block_kv, C] = K_step [block_kv, H] · q^T [H, C]
    out^T    [H, C]       += V_step^T [H, block_kv] · P^T [block_kv, C]

Both products run on float8 tensor cores with the K-major operands float8 needs: K's rows as stored, V's block as
"HND_VT" stores it (transposed, [H, S]), and q's and P's float8 parts kept [C, ...] in shared memory. The CTA reads
its request's q rows from [T, N, H] itself (TMA pieces of whole rows into untiled staging rows) and splits them
into two float8 parts (hi + lo), each column scaled by its own power of two (`cta_parts.power_of_two_scale`), which
that column's logit scale divides out; P, scaled by `P_SCALE`, goes in `KernelConfig.p_parts` parts.
The softmax runs down the keys (the accumulator's rows, reduced across the warpgroup's warps): each step rescales
out^T and an elementwise running sum of P, which is reduced over the keys once, at the end.

The producer warpgroup streams ``block_kv`` keys per step (a part of one block, or several whole blocks, each its
own V^T tile and P^T part) by TMA into a ring of ``KernelConfig.num_stages`` slots, as the tile kernel's does.
Every step is masked (C columns make the mask cheap); on a step holding keys outside the CTA's range V's columns
there are zeroed, since stale or NaN memory must not reach ``0 * V``.

With one split, the CTA writes its tokens' final rows into [T, N, H] (sinks, v scale, the output's dtype; through
the staging rows, transposed) and its share of the rows no request holds (a flagged request's, the padding after
the last request): the call is one launch, and a reduction over the block table where the metadata does not vouch
for its ids. With several, each split writes its normalized output [H, C] and log-sum-exp [C], which
`tiles.token_outputs` merges with the sinks and the v scale.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._compat import plgpu, resolve_interpret
from ..layout import FP8_DTYPE
from ..masks import attention_mask
from .config import SMEM_BUDGET_BYTES, KernelConfig
from .launch import NO_WINDOW
from .cta_parts import (LOG2E, MASKED_LOGIT, P_SCALE, accumulate, power_of_two_scale, sink_logits, smem_transforms,
                        split_key_steps, zero_foreign_columns)
from .cta_parts import normalized as normalize

COLUMN_MULTIPLE = 8  # wgmma N: the narrow side holds a multiple of 8 columns
MAX_COLUMNS = 64
STAGING_ROW_MULTIPLE = 32


def narrow_columns(group_size: int, max_query_len: int) -> int | None:
    """The query columns C of a launch whose requests hold at most `max_query_len` tokens of G heads each: G times
    the tokens, rounded up to a multiple of 8; None above `MAX_COLUMNS` (the tile kernel serves those)."""
    columns = -(-group_size * max_query_len // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
    return columns if columns <= MAX_COLUMNS else None


def staging_rows(columns: int) -> int:
    """Rows of the q and output staging tiles: C rounded up to `STAGING_ROW_MULTIPLE` (the register layout that
    copies them spreads whole 8-row tiles over the warpgroup's four warps)."""
    return -(-columns // STAGING_ROW_MULTIPLE) * STAGING_ROW_MULTIPLE


def smem_bytes(config: KernelConfig, head_dim: int, columns: int, *, q_itemsize: int = 2) -> int:
    """Shared memory of one CTA (float8 K and V rings, the q / output staging rows, q's float8 parts and column
    scales, P's parts, the partial output tile; barriers aside)."""
    rows = staging_rows(columns)
    ring = 2 * config.num_stages * config.block_kv * head_dim
    staging = rows * head_dim * (q_itemsize + config.q_parts) + 4 * rows
    return ring + staging + config.p_parts * columns * config.block_kv + 4 * columns * (head_dim + 1)


def narrow_decode_cta(query_start_loc_ref, seq_lens_ref, block_tables_ref, request_flags_ref, num_actual_tokens_ref,
                      window_ref, sm_scale_ref, k_scale_ref, v_scale_ref, sinks_ref, q_ref, k_ref, v_ref, o_ref,
                      lse_ref=None, *, block_size, group_size, columns, max_query_len, params, stacked, has_sinks,
                      config, acc_in_registers):  # fmt: skip
    """One CTA: the producer and consumer warpgroups of one (request, KV head, split). Without `lse_ref` (one
    split) it writes its tokens' final output rows into [T, N, H] itself, and its share of the rows no request's
    tile holds."""
    num_tokens, _, head_dim = q_ref.shape
    num_blocks, capacity = k_ref.shape[0], block_tables_ref.shape[1] * block_size
    num_reqs = seq_lens_ref.shape[0]
    direct = lse_ref is None
    tokens = columns // group_size  # column g * tokens + j: head g, token j
    rows = staging_rows(columns)
    block_kv, num_stages = config.block_kv, config.num_stages
    # A step's keys: one block's part (S >= block_kv) or several whole blocks, each its own V^T tile ("pages")
    page_keys = min(block_size, block_kv)
    pages = block_kv // page_keys
    request, kv_head, split = lax.axis_index("request"), lax.axis_index("kv_head"), lax.axis_index("split")
    mask = dict(params=params, sliding_window=window_ref[0])
    logits_soft_cap = params.logits_soft_cap
    first_token = query_start_loc_ref[request]
    query_len = query_start_loc_ref[request + 1] - first_token
    raw_seq_len = seq_lens_ref[request]
    # What `validation.unservable_requests` flags, but the block ids (`request_flags`): the request's tokens get NaN
    flagged = ((request_flags_ref[request] != 0) | (query_len > max_query_len) | (query_len > raw_seq_len)
               | (raw_seq_len > capacity))  # fmt: skip
    served_len = jnp.where(flagged, 0, jnp.clip(query_len, 0, tokens))  # flagged: no keys streamed, no q read
    seq_len = jnp.minimum(raw_seq_len, capacity)
    first_q_pos = seq_len - served_len
    # Keys some query of the request sees: [key_lo, key_hi]; this split streams its share of the steps holding them
    key_lo, key_hi, my_lo, my_hi = split_key_steps(first_q_pos, served_len, seq_len, split, mask=mask,
                                                   block_kv=block_kv, num_splits=config.num_splits)  # fmt: skip
    block_lo, block_hi = key_lo // block_size, key_hi // block_size
    # The request's tokens as pieces of whole rows (powers of two, largest first): for each head g, the staging
    # rows g * tokens + [offset, offset + size) and q's or the output's [T, N, H] rows of its tokens; one piece of
    # G rows (the group's heads of the one token) where a request has at most one
    piece_sizes = [1 << i for i in reversed(range(tokens.bit_length()))]

    def token_pieces(staging, copy, skip=None):
        if tokens == 1:
            heads = pl.ds(kv_head * group_size, group_size)
            pl.when(served_len == 1)(lambda: copy(staging.at[pl.ds(0, group_size)], (first_token, heads)))
            if skip is not None:
                pl.when(served_len != 1)(skip)
            return
        for g in range(group_size):
            for size in piece_sizes:
                offset = served_len & ~(2 * size - 1)
                smem_rows = staging.at[pl.ds(g * tokens + offset, size)]
                token_rows = (pl.ds(first_token + offset, size), kv_head * group_size + g)
                pl.when(served_len & size != 0)(partial(copy, smem_rows, token_rows))
                if skip is not None:
                    pl.when(served_len & size == 0)(skip)

    def ring_slot(step):
        return lax.rem(step - my_lo, num_stages)

    def checked_scale(scale):  # a k or v scale that is not finite and > 0 becomes NaN (`layout.KVCache.scales`)
        return jnp.where((scale > 0) & (scale < jnp.inf), scale, jnp.float32(jnp.nan))

    def producer(k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed):
        @pl.loop(my_lo, my_hi)
        def _(step):
            slot = ring_slot(step)
            reused = step - my_lo >= num_stages  # the slot held an earlier step: wait until consumed
            # the step's blocks, read from the block table together; a block past the keys repeats the last one,
            # and no id leaves the pool (a request with one outside it is flagged)
            ids = [jnp.clip(block_tables_ref[request, jnp.clip((step * block_kv + p * page_keys) // block_size,
                                                               block_lo, block_hi)], 0, num_blocks - 1)
                   for p in range(pages)]  # fmt: skip
            step_rows = pl.ds(lax.rem(step * block_kv, block_size), page_keys)
            pl.when(reused)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
            for p, page in enumerate(ids):  # stacked: one array [B, 2, ...] holds K and V
                block = (page, 0) if stacked else (page,)
                plgpu.copy_gmem_to_smem(k_ref.at[block + (kv_head, step_rows)],
                                        k_ring.at[slot, pl.ds(p * page_keys, page_keys)], k_loaded.at[slot])
            pl.when(reused)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
            for p, page in enumerate(ids):
                block = (page, 1) if stacked else (page,)
                plgpu.copy_gmem_to_smem(v_ref.at[block + (kv_head, slice(None), step_rows)], v_ring.at[slot, p],
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

    def float8_query(staging, q_parts, column_scales):
        """q's columns from the staging rows into `q_parts` (hi = float8(q), lo = float8(q - hi)), each column
        scaled by its own power of two (`power_of_two_scale`, stored in `column_scales` for the logits); columns
        that hold no token are 0."""
        layout = plgpu.Layout.SMEM_GMEM_COPY((rows, head_dim), q_ref.dtype, staging_swizzle)
        q = plgpu.load(staging, layout=layout).astype(jnp.float32)
        column = plgpu.broadcasted_iota(jnp.int32, q.shape, 0, layout=layout)
        q = jnp.where((column < group_size * tokens) & (lax.rem(column, tokens) < served_len), q, 0.0)
        scale = power_of_two_scale(jnp.abs(q).max(axis=1))
        q = q * lax.broadcast_in_dim(scale, q.shape, [0])
        high = q.astype(FP8_DTYPE)
        q_parts[0] = high
        if config.q_parts == 2:
            q_parts[1] = (q - high.astype(jnp.float32)).astype(FP8_DTYPE)
        column_scales[...] = scale
        plgpu.commit_smem()

    def consumer(staging, q_parts, column_scales, p_parts, out_smem, lse_smem, k_ring, v_ring, k_loaded, v_loaded,
                 k_consumed, v_consumed, q_loaded):  # fmt: skip
        plgpu.barrier_wait(q_loaded)
        float8_query(staging, q_parts, column_scales)
        # Logits go to base 2 for exp2; without a soft cap the two scales fold into one multiply. Each column's
        # logits divide out its q scale.
        logit_scale = sm_scale_ref[0] * checked_scale(k_scale_ref[0])
        if logits_soft_cap is None:
            logit_scale = logit_scale * LOG2E
        q_scales = plgpu.load(column_scales.at[pl.ds(0, columns)], layout=plgpu.Layout.WGMMA.reduce(0))
        logit_scales = logit_scale / q_scales
        score_shape = (block_kv, columns)
        q_pos = first_q_pos + lax.rem(iota(score_shape, 1), tokens)

        def step_body(step, carry):
            acc, m_i, p_sums = carry
            slot = ring_slot(step)
            plgpu.barrier_wait(k_loaded.at[slot])

            def scores_t(acc_ref):
                for part in range(config.q_parts):
                    plgpu.wgmma(acc_ref, k_ring.at[slot], q_parts.at[part, pl.ds(0, columns)].transpose((1, 0)))
                return acc_ref[...]

            scores = pl.run_scoped(scores_t, plgpu.ACC(score_shape, jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            logits = scores * lax.broadcast_in_dim(logit_scales, score_shape, [1])
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
        if direct:
            write_tokens(staging, normalized(acc, m_i, l_i))
            return
        has_keys = l_i > 0
        out_smem[...] = acc * lax.broadcast_in_dim(1 / (P_SCALE * jnp.where(has_keys, l_i, 1.0)), acc.shape, [1])
        lse_smem[...] = jnp.where(has_keys, (m_i + jnp.log2(jnp.where(has_keys, l_i, 1.0))) / LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[request, kv_head, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[request, kv_head, split])
        plgpu.wait_smem_to_gmem(0)

    def normalized(acc, m_i, l_i):
        """out^T [H, C] = acc / (P_SCALE * l); with sinks, each head's sink logit joins the denominator."""
        sinks = None
        if has_sinks:
            head_of_column = jnp.minimum(iota(acc.shape, 1) // tokens, group_size - 1)
            sinks = sink_logits(sinks_ref, head_of_column, first_head=kv_head * group_size, group_size=group_size)
        return normalize(acc * (1 / P_SCALE), m_i, l_i, query_axis=1, sinks=sinks)

    def write_tokens(staging, out_t):
        """The final output rows of the request's tokens straight into [T, N, H] (v scale applied, 0 for padding
        tokens from num_actual_tokens on, in the output's dtype), transposed into the staging rows on the way."""
        token = first_token + lax.rem(iota(out_t.shape, 1), tokens)
        out_t = jnp.where(token < num_actual_tokens_ref[0], out_t * checked_scale(v_scale_ref[0]), 0.0)
        staging_t = staging.transpose((1, 0))
        staging_t[:, pl.ds(0, columns)] = plgpu.layout_cast(out_t, plgpu.Layout.WGMMA_TRANSPOSED).astype(o_ref.dtype)
        plgpu.commit_smem()
        token_pieces(staging, lambda smem_rows, token_rows: plgpu.copy_smem_to_gmem(smem_rows, o_ref.at[token_rows]))
        plgpu.wait_smem_to_gmem(0)

    def fill_unheld_rows(staging):
        """The rows of this CTA's heads that no request's tile holds: a flagged request's tokens and this CTA's
        share of the tokens after the last request (every `R`-th from its request index), NaN before
        num_actual_tokens and 0 from there on, one row at a time from two staging rows (0: zeros, 1: NaN)."""
        flagged_count = jnp.where(flagged, jnp.clip(query_len, 0, num_tokens - first_token), 0)
        tail_start = query_start_loc_ref[num_reqs] + request
        tail_count = pl.cdiv(jnp.maximum(num_tokens - tail_start, 0), num_reqs)

        @pl.when((flagged_count > 0) | (tail_count > 0))
        def _():
            layout = plgpu.Layout.SMEM_GMEM_COPY((rows, head_dim), o_ref.dtype, staging_swizzle)
            row = plgpu.broadcasted_iota(jnp.int32, (rows, head_dim), 0, layout=layout)
            staging[...] = jnp.where(row == 1, jnp.float32(jnp.nan), 0.0).astype(o_ref.dtype)
            plgpu.commit_smem()

            def fill(token):
                value = staging.at[pl.ds(jnp.where(token < num_actual_tokens_ref[0], 1, 0), 1)]
                for g in range(group_size):
                    plgpu.copy_smem_to_gmem(value, o_ref.at[pl.ds(token, 1), kv_head * group_size + g])

            pl.loop(0, flagged_count)(lambda i: fill(first_token + i))
            pl.loop(0, tail_count)(lambda i: fill(tail_start + i * num_reqs))
            plgpu.wait_smem_to_gmem(0)

    def body(staging, q_parts, column_scales, p_parts, out_smem, lse_smem, k_ring, v_ring, q_loaded, k_loaded,
             v_loaded, k_consumed, v_consumed):  # fmt: skip
        ring = (k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed)
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _():
            producer(*ring)

        @pl.when(wg == 0)
        def _():
            token_pieces(staging, lambda smem_rows, token_rows: plgpu.copy_gmem_to_smem(q_ref.at[token_rows], smem_rows,
                                                                                        q_loaded),
                         skip=lambda: plgpu.barrier_arrive(q_loaded))  # every piece arrives once  # fmt: skip
            consumer(staging, q_parts, column_scales, p_parts, out_smem, lse_smem, *ring, q_loaded)
            if direct:
                fill_unheld_rows(staging)

    key_transforms = smem_transforms(page_keys, FP8_DTYPE)  # V^T pages and P's parts: [.., page_keys], K-major
    head_transforms = smem_transforms(head_dim, FP8_DTYPE)  # K steps and q's parts: [.., H], K-major
    staging_swizzle = smem_transforms(head_dim, q_ref.dtype)[1].swizzle
    pieces = 1 if tokens == 1 else group_size * len(piece_sizes)
    pl.run_scoped(
        body,
        plgpu.SMEM((rows, head_dim), q_ref.dtype),  # q's rows, then the output's: untiled, any row a TMA target
        plgpu.SMEM((config.q_parts, rows, head_dim), FP8_DTYPE, transforms=head_transforms),
        plgpu.SMEM((rows,), jnp.float32),  # each column's q scale
        plgpu.SMEM((config.p_parts, pages, columns, page_keys), FP8_DTYPE, transforms=key_transforms),
        None if direct else plgpu.SMEM((head_dim, columns), jnp.float32),
        None if direct else plgpu.SMEM((columns,), jnp.float32),
        plgpu.SMEM((num_stages, block_kv, head_dim), FP8_DTYPE, transforms=head_transforms),
        plgpu.SMEM((num_stages, pages, head_dim, page_keys), FP8_DTYPE, transforms=key_transforms),
        plgpu.Barrier(num_arrivals=pieces),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        collective_axes="wg",
    )


def launch_narrow_decode(
    q, k_source, v_source, query_start_loc, seq_lens, block_tables, request_flags, num_actual_tokens, scales, sinks,
    *, columns, block_size, group_size, max_query_len, params, stacked, config, interpret,
):  # fmt: skip
    """Run the kernel over (request, KV head, split) for a layer of `params` (its scale is in `scales`).

    Args:
      q: [T, N, H] (bfloat16 or float16): each CTA reads its request's tokens and splits them into float8 parts.
      k_source, v_source: with `stacked`, the one cache [B, 2, K, S, H] twice; else the pair's K and V caches
        [B, K, S, H]. v_source viewed as [..., K, H, S] (V transposed per block: "HND_VT").
      query_start_loc: [R+1]; seq_lens: [R] (more than the block table holds: flagged); block_tables: [R, P]
        (ids are clipped into the pool).
      request_flags: [R] int32, nonzero for requests whose block ids leave the pool (`unservable_requests`'
        table check; the kernel checks the lengths itself).
      num_actual_tokens: [1] int32, the first padding token.
      scales: ([1] sm_scale, [1] k_scale, [1] v_scale), float32: passed apart (a stack of traced scales would be
        a kernel of its own).
      sinks: [N] float32 or None.
      columns: C, from `narrow_columns(G, max_query_len)`.
    Returns:
      with one split, the output [T, N, H] in q's dtype (NaN for the tokens of flagged requests and those before
      num_actual_tokens that no request holds, 0 for padding). Else the partial outputs [R, K, splits, H, C]
      (float32, normalized per split, no sinks or v scale; transposed) and their log-sum-exps [R, K, splits, C]
      (natural log; -inf where a split saw no key), for `tiles.token_outputs`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_reqs, num_kv_heads = seq_lens.shape[0], num_q_heads // group_size
    needed = smem_bytes(config, head_dim, columns, q_itemsize=q.dtype.itemsize)
    if needed > SMEM_BUDGET_BYTES:
        raise NotImplementedError(f"{config} needs {needed} bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    if block_size % config.block_kv and config.block_kv % block_size:
        raise ValueError(f"{block_size=} must divide block_kv={config.block_kv} or be a multiple of it")
    interpret = resolve_interpret(interpret)
    window = jnp.full((1,), NO_WINDOW if params.sliding_window is None else params.sliding_window, jnp.int32)
    params = dataclasses.replace(params, sliding_window=None, sm_scale=None)
    kernel = partial(narrow_decode_cta, block_size=block_size, group_size=group_size, columns=columns,
                     max_query_len=max_query_len, params=params, stacked=stacked, has_sinks=sinks is not None,
                     config=config, acc_in_registers=interpret is None)  # fmt: skip
    splits = config.num_splits
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((num_reqs, num_kv_heads, splits, head_dim, columns), jnp.float32),
            jax.ShapeDtypeStruct((num_reqs, num_kv_heads, splits, columns), jnp.float32),
        )
    sinks = jnp.zeros((1,), jnp.float32) if sinks is None else sinks
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_reqs, num_kv_heads, splits),
        grid_names=("request", "kv_head", "split"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(query_start_loc, seq_lens, block_tables, request_flags, num_actual_tokens, window, *scales, sinks, q, k_source,
      v_source)  # fmt: skip
