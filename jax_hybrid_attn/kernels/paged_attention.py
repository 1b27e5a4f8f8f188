"""Paged attention over query tiles in Pallas Mosaic GPU: a producer warpgroup and one or two consumers.

A query tile holds ``64 * num_consumers`` wgmma rows; each consumer warpgroup owns 64 of them, the G query
heads of one KV head for ``64 // G`` consecutive tokens (row ``g * (64 // G) + j``: head g, token j). One CTA
per work item (tile, KV head, split). The producer warpgroup streams the blocks between the first key any query
of the tile may see and the last (window, chunk or sequence end) by TMA through the block table,
``block_kv // S`` blocks per step (``block_kv`` rows of one block when S is a multiple of ``block_kv``), into a
ring of `num_stages` slots that the consumers release through "consumed" barriers. Decode tiles use one consumer
and split the keys across CTAs (flash-decoding); prefill tiles use two consumers that share every K/V step and
take turns on the tensor cores (a schedule barrier, as FlashAttention-3 does).

Masks are applied only on steps that straddle an edge of a consumer's key range. On a step that holds keys
outside the tile's range (a block's unwritten tail, or a clamped duplicate block), V rows that no query
sees are zeroed first: stale or NaN memory must not reach ``0 * V``. With two consumers, consumer 0 zeroes
and signals consumer 1 through the slot's barrier. With a float8_e4m3fn cache, QK runs on float8 tensor cores
straight from the K ring, q split once per tile into two float8 parts (hi + lo, two wgmmas: about bfloat16's
precision), and V is converted to float16 in each consumer's staging buffer (zeroing happens there) for the PV
product, whose operand must be K-major in float8; its k scale multiplies the logits and its v scale the output.
An "HND_VT" float8 cache holds V transposed per block ([H, S], K-major): the producer copies it by TMA into a ring
that the PV product reads as it is, on float8 tensor cores, with P in two float8 parts (hi + lo, or one:
`KernelConfig.p_parts`; scaled by `P_SCALE` so that small probabilities stay normal) through each consumer's
shared tile; foreign V columns are zeroed as rows are on other caches. Otherwise P stays in registers for the PV
wgmma on the GPU; in CPU interpret mode, which runs wgmma only from shared memory, it goes through a shared-memory
tile instead.

Packed tiles (q gathered into [NT, K, rows, H]): each split writes its normalized partial output and its
log-sum-exp; `tiles.merge_splits` combines them with the sinks, which enter the denominator only. With `direct`
(one split, G = 1, 2, 4 or 8: prefill tiles, and decode tiles that are not split) each consumer reads its rows of
each head from q [T, N, H] and writes its final output rows there (sinks and v scale applied, NaN for a flagged
request, 0 for padding tokens), by TMA through an untiled staging tile: a request's tokens start anywhere, not
on an 8-row tile, and are copied in exact power-of-two pieces, so no copy crosses into another request's rows.

This module is the kernel body only (`launch.py` launches it over the work items, its options are in `config.py`,
the tiles around it in `tiles.py`); it stays one module because the body is one Pallas function whose producer,
consumers and barrier protocol share its refs and are easiest to check together.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._compat import plgpu
from ..masks import allowed_key_range, attention_mask
from .config import ROWS
from .cta_parts import (LOG2E, MASKED_LOGIT, P_SCALE, accumulate, sink_logits, smem_transforms, split_key_steps,
                        zero_foreign_columns)
from .cta_parts import normalized as normalize

def take_turn(schedule) -> None:
    """Two consumer warpgroups alternate on the tensor cores: each arrival lets the other one go."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def paged_attention_cta(
    tile_request_ref, tile_query_start_ref, tile_query_len_ref, seq_lens_ref, query_lens_ref, block_tables_ref,
    query_start_loc_ref, request_flags_ref, num_actual_tokens_ref, scales_ref, window_ref, sinks_ref, q_ref, k_ref, v_ref,
    o_ref, lse_ref=None, *, block_size, group_size, num_kv_heads, params, kv_layout, stacked, direct, has_sinks, compute_dtype, config,
    p_in_registers,
):  # fmt: skip
    """One CTA: the producer and consumer warpgroups of one (query tile, KV head, split).

    Long on purpose: it is one Pallas kernel body. Its nested functions (producer, consumer, their steps) close
    over the refs, the tile's key range and the static configuration, which every one of them reads; as
    module-level functions each would take a dozen of these as arguments, and the barrier protocol between
    them (ring slots, "loaded"/"consumed", the consumers' turns) is easiest to check when it sits in one place.
    """
    head_dim = q_ref.shape[-1]
    dtype = compute_dtype  # the wgmma operands'
    # float8 cache: QK on float8 tensor cores from the K ring; V transposed ("HND_VT") read by a float8 PV product
    # from its ring, else converted by the consumers into float16 staging buffers
    converts = k_ref.dtype != dtype
    v_transposed = kv_layout == "HND_VT"
    stages_v = converts and not v_transposed
    if converts and dtype != jnp.float16:  # sm90 converts e4m3 to float16 in one instruction, to bfloat16 not at all
        raise ValueError(f"a {k_ref.dtype} cache needs compute_dtype float16, not {dtype}")
    block_kv, num_stages, num_consumers = config.block_kv, config.num_stages, config.num_consumers
    # A step's block_kv keys come from several whole pages (S <= block_kv) or from a part of one (S > block_kv)
    pages_per_step = max(1, block_kv // block_size)
    rows_per_page = min(block_size, block_kv)
    if v_transposed and (not converts or block_size % block_kv):
        raise ValueError(f"an HND_VT cache needs float8 and steps within one block: {k_ref.dtype} {block_size=} "
                         f"{block_kv=}")  # fmt: skip
    tokens_per_consumer = ROWS // group_size  # rows g * tokens_per_consumer + j: head g, token j
    logits_soft_cap = params.logits_soft_cap
    if params.sliding_window is not None or params.sm_scale is not None:
        raise ValueError(f"{params=}: the kernel reads the window from window_ref and the scale from scales_ref")
    mask = dict(params=params, sliding_window=window_ref[0])  # the layer's window (`NO_WINDOW`: none) as data
    # With `direct`, a consumer's tokens of one head are copied in pieces of these sizes (powers of two)
    row_pieces = [tokens_per_consumer >> i for i in range(tokens_per_consumer.bit_length())]

    def consumer_rows(tile, wg):
        """(offset of consumer `wg`'s first token in its tile, its number of tokens)."""
        offset = wg * tokens_per_consumer
        return offset, jnp.clip(tile_query_len_ref[tile] - offset, 0, tokens_per_consumer)

    def token_block(tile, wg):
        """With `direct`: the first of consumer `wg`'s tokens in q and the output [T, N, H], their number, and
        whether its request is flagged (its tokens come out NaN)."""
        request = tile_request_ref[tile]
        offset, length = consumer_rows(tile, wg)
        first_token = query_start_loc_ref[request] + tile_query_start_ref[tile] + offset
        return first_token, length, request_flags_ref[request] != 0

    def work_item(tile, kv_head, split):
        """The producer and consumer of one (query tile, KV head, split), and its number of key steps; both read
        the same ring slots in the same order."""
        request = tile_request_ref[tile]
        seq_len = seq_lens_ref[request]
        query_len = query_lens_ref[request]
        tile_start, tile_len = tile_query_start_ref[tile], tile_query_len_ref[tile]
        first_q_pos = seq_len - query_len + tile_start
        # Keys some query of the tile sees: [key_lo, key_hi]. The CTA streams its split's steps holding them (none
        # for an idle tile, or a request with no context: the tokens after the last request).
        key_lo, key_hi, my_lo, my_hi = split_key_steps(first_q_pos, tile_len, seq_len, split, mask=mask,
                                                       block_kv=block_kv, num_splits=config.num_splits)  # fmt: skip
        block_lo, block_hi = key_lo // block_size, key_hi // block_size

        def ring_slot(step):
            return lax.rem(step - my_lo, num_stages)

        def holds_foreign_keys(step):
            """Whether the step holds keys outside [key_lo, key_hi], whose V rows must be zeroed."""
            return (step * block_kv < key_lo) | ((step + 1) * block_kv - 1 > key_hi)

        def kv_source(page, kv, rows):
            """Rows `rows` of block `page` of K (kv = 0) or V (kv = 1), this KV head: [rows, H]; V transposed:
            [H, rows]."""
            block = (page, kv) if stacked else (page,)  # stacked: one array [B, 2, ...] holds both
            if kv and v_transposed:
                return v_ref.at[block + (kv_head, slice(None), rows)]
            heads = (rows, kv_head, slice(None)) if kv_layout == "NHD" else (kv_head, rows)
            return (v_ref if kv else k_ref).at[block + heads]

        def zero_foreign_rows(v, first_key):
            """`v` holds keys from `first_key` on; rows outside [key_lo, key_hi] become 0."""
            keys = lax.broadcasted_iota(jnp.int32, v.shape, 0) + first_key
            return jnp.where((keys >= key_lo) & (keys <= key_hi), v, jnp.zeros_like(v))

        def producer(k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed):
            def load_pages(step):
                """The step's pages, read from the block table together (their latencies overlap) and used for K and V."""
                blocks = [
                    jnp.clip((step * block_kv + p * rows_per_page) // block_size, block_lo, block_hi)
                    for p in range(pages_per_step)
                ]
                return [block_tables_ref[request, block] for block in blocks]

            def issue(step, pages, ring, loaded, kv):
                slot = ring_slot(step)
                # The step's rows within its page when one page spans several steps; else whole pages
                rows = pl.ds(lax.rem(step * block_kv, block_size), block_kv) if block_size > block_kv else slice(None)
                for p, page in enumerate(pages):
                    # a transposed V step is one block's [H, block_kv] (one page per step)
                    ring_rows = pl.ds(p * rows_per_page, rows_per_page)
                    target = ring.at[slot] if kv and v_transposed else ring.at[slot, ring_rows]
                    plgpu.copy_gmem_to_smem(kv_source(page, kv, rows), target, loaded.at[slot])

            @pl.loop(my_lo, my_hi)
            def _(step):
                slot = ring_slot(step)
                reused = step - my_lo >= num_stages  # the slot held an earlier step: wait until consumed
                pages = load_pages(step)
                with jax.named_scope("wait K slot"):
                    pl.when(reused)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
                with jax.named_scope("issue K"):
                    issue(step, pages, k_ring, k_loaded, 0)
                with jax.named_scope("wait V slot"):
                    pl.when(reused)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
                with jax.named_scope("issue V"):
                    issue(step, pages, v_ring, v_loaded, 1)

        def consumer(wg, q_parts, k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed, extras):
            """Online softmax of consumer `wg`'s 64 query rows over the CTA's key steps: masked edge steps, unmasked
            inner steps, masked edge steps. `q_parts`: the QK product's left operands, summed (q's tile, or for a
            float8 cache its two float8 parts). Long for the reason the kernel is: its helpers share its registers'
            layouts and the ring's barriers."""
            v_staging, p_smem, v_zeroed, schedule = extras
            my_offset, my_len = consumer_rows(tile, wg)  # the same for every split
            my_first_q_pos = first_q_pos + my_offset
            # Steps whose keys every query of this consumer sees need no mask.
            all_lo, _ = allowed_key_range(my_first_q_pos + my_len - 1, seq_len, **mask)
            _, all_hi = allowed_key_range(my_first_q_pos, seq_len, **mask)
            inner_lo = jnp.where(my_len > 0, jnp.clip(pl.cdiv(all_lo, block_kv), my_lo, my_hi), my_hi)
            inner_hi = jnp.clip((jnp.minimum(all_hi, seq_len - 1) + 1) // block_kv, inner_lo, my_hi)
            # Logits go to base 2 for exp2; without a soft cap the two scales fold into one multiply.
            logit_scale = scales_ref[0] if logits_soft_cap is not None else scales_ref[0] * LOG2E

            def stage(slot_ref, staging, step, *, zero):
                """Convert a float8 step into float16 (zeroing foreign V rows) in this consumer's buffer, 64 rows
                at a time to bound registers."""
                for first_row in range(0, block_kv, ROWS):
                    rows = pl.ds(first_row, ROWS)
                    x = slot_ref[rows].astype(dtype)
                    if zero:  # on steps without foreign keys every row is kept
                        x = zero_foreign_rows(x, step * block_kv + first_row)
                    staging[rows] = x
                plgpu.commit_smem()
                return staging

            def prepare_v(step, slot, *, masked):
                """The V operand of this step, foreign rows (columns, transposed) zeroed on edge steps."""
                if stages_v:
                    v = stage(v_ring.at[slot], v_staging, step, zero=masked)
                    plgpu.barrier_arrive(v_consumed.at[slot])
                    return v

                def zero_foreign_keys():
                    if v_transposed:
                        zero_foreign_columns(v_ring.at[slot], step * block_kv, key_lo, key_hi)
                    else:
                        v_ring[slot] = zero_foreign_rows(v_ring[slot], step * block_kv)
                        plgpu.commit_smem()

                if masked:
                    if num_consumers == 1:
                        pl.when(holds_foreign_keys(step))(zero_foreign_keys)
                    else:

                        @pl.when(holds_foreign_keys(step) & (wg == 0))
                        def _():
                            zero_foreign_keys()
                            plgpu.barrier_arrive(v_zeroed.at[slot])

                        @pl.when(holds_foreign_keys(step) & (wg == 1))
                        def _():
                            plgpu.barrier_wait(v_zeroed.at[slot])

                return v_ring.at[slot]

            def online_softmax(step, scores, m_i, l_i, *, masked):
                """The step's raw scores -> base-2 logits (scaled, soft-capped, masked on edge steps) -> p in q's dtype,
                the new row maxima and sums, and the factor alpha that rescales what was accumulated before."""
                logits = scores * logit_scale
                if logits_soft_cap is not None:
                    logits = (logits_soft_cap * LOG2E) * jnp.tanh(logits / logits_soft_cap)
                if masked:  # positions built here, not before the loops, where they would hold registers throughout
                    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    q_pos = my_first_q_pos + lax.rem(rows, tokens_per_consumer)
                    k_pos = step * block_kv + cols
                    logits = jnp.where(
                        attention_mask(q_pos, k_pos, seq_len, **mask), logits, MASKED_LOGIT
                    )
                m_new = jnp.maximum(m_i, logits.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                p_operand = p * P_SCALE if v_transposed else p  # the float8 parts' range (the output divides it out)
                return p_operand.astype(dtype), m_new, l_i * alpha + p.sum(axis=1), alpha

            def step_body(step, carry, *, masked):
                acc, m_i, l_i = carry
                slot = ring_slot(step)
                # The named scopes are the phases of `benchmarks/kernel_timeline.py` (Mosaic GPU's on-device profiler);
                # without `KernelConfig.profile_dir` they emit nothing.
                with jax.named_scope("wait K"):
                    plgpu.barrier_wait(k_loaded.at[slot])
                    k = k_ring.at[slot]

                def compute_qk(acc_ref):
                    with jax.named_scope("QK issue, turn"):
                        for q_part in q_parts:
                            plgpu.wgmma(acc_ref, q_part, k.transpose((1, 0)))
                        if schedule is not None:
                            take_turn(schedule)
                    with jax.named_scope("QK wait"):
                        return acc_ref[...]

                scores = pl.run_scoped(compute_qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_consumed.at[slot])
                with jax.named_scope("softmax"):
                    p, m_new, l_i, alpha = online_softmax(step, scores, m_i, l_i, masked=masked)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if schedule is not None:
                    plgpu.barrier_arrive(schedule)
                with jax.named_scope("wait V"):
                    plgpu.barrier_wait(v_loaded.at[slot])
                    v = prepare_v(step, slot, masked=masked)
                if schedule is not None:
                    with jax.named_scope("wait turn"):
                        plgpu.barrier_wait(schedule)
                with jax.named_scope("PV"):
                    acc = accumulate_pv(acc, p, v)
                if not stages_v:
                    plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l_i

            def accumulate_pv(acc, p, v):
                """acc + p @ v. P comes from registers; interpret mode takes it through this consumer's shared tile
                and, as it cannot start an accumulator from registers, adds a fresh one. With V transposed, P's two
                float8 parts go through the consumer's shared tiles on every device (the float8 product takes P
                from registers only in a layout that P's is not)."""

                def issue(acc_ref):
                    if v_transposed:
                        high = p.astype(k_ref.dtype)
                        p_smem[0] = high
                        if config.p_parts == 2:
                            p_smem[1] = (p - high.astype(p.dtype)).astype(k_ref.dtype)
                        plgpu.commit_smem()
                        for part in range(config.p_parts):
                            plgpu.wgmma(acc_ref, p_smem.at[part], v.transpose((1, 0)))
                    elif p_in_registers:
                        plgpu.wgmma(acc_ref, p, v)
                    else:
                        p_smem[...] = p
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, p_smem, v)

                return accumulate(acc, issue, in_registers=p_in_registers)

            carry = (
                plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((ROWS,), MASKED_LOGIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            )
            carry = lax.fori_loop(my_lo, inner_lo, partial(step_body, masked=True), carry)
            carry = lax.fori_loop(inner_lo, inner_hi, partial(step_body, masked=False), carry)
            return lax.fori_loop(inner_hi, my_hi, partial(step_body, masked=True), carry)

        return producer, consumer, my_hi - my_lo

    def row_iota(shape):
        """Each element's row, in the wgmma accumulator's register layout."""
        return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)

    def body(q_smem, q8_smem, lse_smem, rows_smem, k_ring, v_ring, v_staging, p_smem, q_loaded, k_loaded, v_loaded,
             k_consumed, v_consumed, v_zeroed, schedule):  # fmt: skip
        wg = lax.axis_index("wg")
        tile, kv_head, split = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("split")
        ring = (k_ring, v_ring, k_loaded, v_loaded, k_consumed, v_consumed)

        @pl.when(wg == num_consumers)
        def _():
            if num_consumers > 1:
                plgpu.set_max_registers(config.producer_registers, action="decrease")
            producer, _, end = work_item(tile, kv_head, split)
            producer(*ring)

            # The last steps' consumption, which no later load waited for: every phase of a barrier the producer
            # waits on is observed before the barriers are released (interpret mode checks it)
            @pl.loop(jnp.maximum(end - num_stages, 0), end)
            def _(position):
                slot = lax.rem(position, num_stages)
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])

        def run_consumer(wg):
            if num_consumers > 1:
                plgpu.set_max_registers(config.consumer_registers, action="increase")
            rows = pl.ds(wg * ROWS, ROWS)
            extras = (
                None if v_staging is None else v_staging.at[wg],
                None if p_smem is None else p_smem.at[wg],
                v_zeroed,
                schedule,
            )

            def token_row_pieces(kv_head, first_token, num_tokens, copy, skip=None):
                """With `direct`: `copy(smem rows, [T, N, H] rows)` for this consumer's `num_tokens` tokens of each
                head of the group, in power-of-two pieces (exact, never past a request's or the array's end; T-row
                copies need not start on an 8-row tile, hence the untiled `rows_smem`); `skip()` for each piece
                left out."""
                for g in range(group_size):
                    for size in row_pieces:
                        offset = num_tokens & ~(2 * size - 1)  # the larger pieces come first
                        smem_rows = rows_smem.at[wg, pl.ds(g * tokens_per_consumer + offset, size)]
                        token_rows = (pl.ds(first_token + offset, size), kv_head * group_size + g)
                        pl.when(num_tokens & size != 0)(partial(copy, smem_rows, token_rows))
                        if skip is not None:
                            pl.when(num_tokens & size == 0)(skip)

            def load_query():
                loaded = q_loaded.at[wg]
                if not direct:
                    plgpu.copy_gmem_to_smem(q_ref.at[tile, kv_head, rows], q_smem.at[wg], loaded)
                    return
                first_token, num_tokens, _ = token_block(tile, wg)
                token_row_pieces(
                    kv_head, first_token, num_tokens,
                    lambda smem_rows, token_rows: plgpu.copy_gmem_to_smem(q_ref.at[token_rows], smem_rows, loaded),
                    skip=lambda: plgpu.barrier_arrive(loaded),  # every piece arrives once
                )  # fmt: skip

            def normalized(acc, m_i, l_i, kv_head):
                """acc / l; with `direct` and sinks, each head's sink logit joins the denominator."""
                sinks = None
                if direct and has_sinks:
                    sinks = sink_logits(sinks_ref, row_iota(acc.shape) // tokens_per_consumer,
                                        first_head=kv_head * group_size, group_size=group_size)  # fmt: skip
                return normalize(acc, m_i, l_i, query_axis=0, sinks=sinks)

            def consume():
                _, consumer, _ = work_item(tile, kv_head, split)
                plgpu.barrier_wait(q_loaded.at[wg])
                if direct:  # into the wgmma's tiled, swizzled layout (rows past the tokens hold stale values)
                    q_rows = plgpu.load(rows_smem.at[wg], layout=copy_layout)
                    if converts:  # q scaled into float16 (`mixed_batch.float16_query`)
                        q_rows = q_rows.astype(jnp.float32) * scales_ref[2]
                    q_smem[wg] = q_rows.astype(dtype)
                    plgpu.commit_smem()
                if converts:  # q's two float8 parts, once per tile: hi = float8(q), lo = float8(q - hi)
                    q_rows = q_smem[wg].astype(jnp.float32)
                    high = q_rows.astype(k_ref.dtype)
                    q8_smem[wg, 0] = high
                    q8_smem[wg, 1] = (q_rows - high.astype(jnp.float32)).astype(k_ref.dtype)
                    plgpu.commit_smem()
                q_parts = tuple(q8_smem.at[wg, part] for part in range(config.q_parts)) if converts else (q_smem.at[wg],)
                if schedule is not None:
                    pl.when(wg == 1)(partial(take_turn, schedule))
                acc, m_i, l_i = consumer(wg, q_parts, *ring, extras)
                if schedule is not None:
                    pl.when(wg == 0)(partial(take_turn, schedule))
                if v_transposed:
                    acc = acc * (1 / P_SCALE)
                out = normalized(acc, m_i, l_i, kv_head)
                if direct:  # the final output rows straight into [T, N, H]: v scale applied, NaN for a flagged
                    # request, 0 for padding tokens (from num_actual_tokens on), in the output's dtype
                    first_token, num_tokens, flagged = token_block(tile, wg)
                    token = first_token + lax.rem(row_iota(out.shape), tokens_per_consumer)
                    out = out * jnp.where(flagged, jnp.float32(jnp.nan), scales_ref[1])
                    rows_smem[wg] = jnp.where(token < num_actual_tokens_ref[0], out, 0.0).astype(o_ref.dtype)
                    plgpu.commit_smem()
                    token_row_pieces(
                        kv_head, first_token, num_tokens,
                        lambda smem_rows, token_rows: plgpu.copy_smem_to_gmem(smem_rows, o_ref.at[token_rows]),
                    )  # fmt: skip
                else:  # normalized per split, with the log-sum-exp that `tiles.merge_splits` weighs the splits by
                    q_smem[wg] = out.astype(dtype)
                    has_keys = l_i > 0
                    log_sum = (m_i + jnp.log2(jnp.where(has_keys, l_i, 1.0))) / LOG2E
                    lse_smem[wg] = jnp.where(has_keys, log_sum, -jnp.inf)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[tile, kv_head, split, rows])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[tile, kv_head, split, rows])
                plgpu.wait_smem_to_gmem(0)

            load_query()
            consume()

        # The traced index, even with one consumer: a static `.at[0]` view cannot feed wgmma in pl.run_state.
        pl.when(wg < num_consumers)(lambda: run_consumer(wg))

    q_transforms = smem_transforms(head_dim, dtype)
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((ROWS, head_dim), q_ref.dtype, q_transforms[1].swizzle)
    kv_transforms = smem_transforms(head_dim, k_ref.dtype)
    ring_shape = (num_stages, block_kv, head_dim)
    # a transposed V step [H, block_kv] and P's float8 parts [ROWS, block_kv]: the PV product's K-major operands
    key_transforms = smem_transforms(block_kv, k_ref.dtype)
    if v_transposed:
        v_ring = plgpu.SMEM((num_stages, head_dim, block_kv), k_ref.dtype, transforms=key_transforms)
        p_shape = (num_consumers, config.p_parts, ROWS, block_kv)
        p_tiles = plgpu.SMEM(p_shape, k_ref.dtype, transforms=key_transforms)
    else:
        v_ring = plgpu.SMEM(ring_shape, k_ref.dtype, transforms=kv_transforms)
        p_tiles = None if p_in_registers else plgpu.SMEM((num_consumers, ROWS, block_kv), dtype,
                                                         transforms=q_transforms)  # fmt: skip
    pl.run_scoped(
        body,
        plgpu.SMEM((num_consumers, ROWS, head_dim), dtype, transforms=q_transforms),
        plgpu.SMEM((num_consumers, 2, ROWS, head_dim), k_ref.dtype, transforms=kv_transforms) if converts else None,
        None if direct else plgpu.SMEM((num_consumers, ROWS), jnp.float32),  # log-sum-exps
        plgpu.SMEM((num_consumers, ROWS, head_dim), o_ref.dtype) if direct else None,
        plgpu.SMEM(ring_shape, k_ref.dtype, transforms=kv_transforms),
        v_ring,
        plgpu.SMEM((num_consumers, block_kv, head_dim), dtype, transforms=q_transforms) if stages_v else None,
        p_tiles,
        plgpu.Barrier(num_arrivals=group_size * len(row_pieces) if direct else 1, num_barriers=num_consumers),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),
        # One per ring slot: consumer 0 may zero the next step's slot (edge steps come in pairs when a tile's
        # keys span two steps) before consumer 1 has waited for this one; with one barrier its phase would
        # complete twice unobserved. A slot is zeroed again only after consumer 1 released it.
        plgpu.Barrier(num_barriers=num_stages) if num_consumers > 1 and not stages_v else None,
        plgpu.Barrier(num_arrivals=num_consumers) if num_consumers > 1 and config.ping_pong else None,
        collective_axes="wg",
    )
