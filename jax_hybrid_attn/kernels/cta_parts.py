"""Pieces of the CTA bodies that both attention kernels use (`paged_attention`, `narrow_decode`): the online
softmax's constants, q's power-of-two scale into float8's range, the shared-memory tiling that wgmma and TMA read,
the key steps of one split, the zeroing of a transposed V step's foreign keys, the accumulation of wgmma products
and the final normalization with the sinks."""

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._compat import plgpu
from ..masks import allowed_key_range
from .config import ROWS

LOG2E = math.log2(math.e)
MASKED_LOGIT = -1e30  # finite, so fully masked steps never produce inf - inf
P_SCALE = 256.0
"""P's multiplier before its float8 parts (the output's divisor after): P <= 1 becomes <= 256, within float8_e4m3fn
(448), and its parts stay normal numbers down to 2^-14 of P's largest value."""
QUERY_EXPONENT = 7
"""`power_of_two_scale` puts q's largest magnitude in [2^7, 2^8): within float8_e4m3fn (448) for q's two float8
parts, and far inside float16 (65504)."""
_F32_MANTISSA_BITS, _F32_EXPONENT_MASK, _F32_BIAS = 23, 0xFF, 127


def power_of_two_scale(largest):
    """The power of two that scales magnitudes up to `largest` (float32, any shape: one scale per element) into
    [2^QUERY_EXPONENT, 2^(QUERY_EXPONENT + 1)), read off the exponent bits (exact; the kernels compute it in
    registers the same way). 1 where `largest` is 0, subnormal, inf or NaN: those reach the output unscaled."""
    exponent = lax.shift_right_logical(lax.bitcast_convert_type(largest, jnp.int32), _F32_MANTISSA_BITS)
    exponent = exponent & _F32_EXPONENT_MASK  # biased; the sign bit dropped
    scaled = jnp.clip(2 * _F32_BIAS + QUERY_EXPONENT - exponent, 1, 2 * _F32_BIAS)  # biased exponent of the scale
    scale = lax.bitcast_convert_type(lax.shift_left(scaled, _F32_MANTISSA_BITS), jnp.float32)
    return jnp.where((exponent > 0) & (exponent < _F32_EXPONENT_MASK), scale, jnp.float32(1))


def smem_transforms(head_dim: int, dtype) -> tuple:
    """Tiling and swizzle of a [rows, head_dim] shared-memory tile that wgmma or TMA reads."""
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    swizzle = 128 if row_bytes % 128 == 0 else 64
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def zero_foreign_columns(v_t, first_key, key_lo, key_hi) -> None:
    """A transposed float8 V step [H, keys] in shared memory holds keys from `first_key` on: its columns outside
    [key_lo, key_hi] become 0 (through float16: no arithmetic on float8 registers), 64 rows at a time to bound
    registers."""
    for first_row in range(0, v_t.shape[0], ROWS):
        rows = pl.ds(first_row, ROWS)
        x = v_t[rows].astype(jnp.float16)
        keys = lax.broadcasted_iota(jnp.int32, x.shape, 1) + first_key
        v_t[rows] = jnp.where((keys >= key_lo) & (keys <= key_hi), x, jnp.zeros_like(x)).astype(v_t.dtype)
    plgpu.commit_smem()


def sink_logits(sinks_ref, head_in_group, *, first_head, group_size: int):
    """Each element's sink logit in base 2 (acc's shape): `head_in_group` [...] int32 names the element's head
    among the G heads from `first_head` of `sinks_ref` [N] (natural log)."""
    sink = jnp.zeros(head_in_group.shape, jnp.float32)
    for g in range(group_size):
        sink = jnp.where(head_in_group == g, sinks_ref[first_head + g] * LOG2E, sink)
    return sink


def normalized(acc, m_i, l_i, *, query_axis: int, sinks=None):
    """acc / l, for the running maximum `m_i` and sum `l_i` (base 2) of each query along acc's `query_axis`; with
    `sinks` (`sink_logits`, acc's shape) each head's sink logit joins the denominator."""
    if sinks is None:
        return acc / lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), acc.shape, [query_axis])
    m = lax.broadcast_in_dim(m_i, acc.shape, [query_axis])
    top = jnp.maximum(m, sinks)
    kept = jnp.exp2(m - top)
    return acc * kept / (lax.broadcast_in_dim(l_i, acc.shape, [query_axis]) * kept + jnp.exp2(sinks - top))


def accumulate(acc, issue, *, in_registers: bool):
    """`acc` plus the wgmma products that ``issue(acc_ref)`` issues: into `acc` itself on the GPU; interpret mode,
    which cannot start an accumulator from registers, issues them into a fresh one and adds it."""
    if in_registers:
        return pl.run_state(issue)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
        issue(acc_ref)
        return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def split_key_steps(first_q_pos, num_queries, seq_len, split, *, mask: dict, block_kv: int, num_splits: int):
    """(key_lo, key_hi, my_lo, my_hi): the keys [key_lo, key_hi] that some of the `num_queries` queries from position
    `first_q_pos` of a request holding `seq_len` keys sees (`mask`: `allowed_key_range`'s options), and the steps of
    `block_kv` keys holding them that split `split` of `num_splits` streams, [my_lo, my_hi): none without queries or
    keys."""
    key_lo, _ = allowed_key_range(first_q_pos, seq_len, **mask)
    _, key_hi = allowed_key_range(first_q_pos + num_queries - 1, seq_len, **mask)
    step_lo, step_hi = key_lo // block_kv, key_hi // block_kv + 1
    steps_per_split = pl.cdiv(jnp.maximum(step_hi - step_lo, 0), num_splits)
    my_lo = jnp.minimum(step_lo + split * steps_per_split, step_hi)
    my_hi = jnp.where((num_queries > 0) & (seq_len > 0), jnp.minimum(my_lo + steps_per_split, step_hi), my_lo)
    return key_lo, key_hi, my_lo, my_hi
