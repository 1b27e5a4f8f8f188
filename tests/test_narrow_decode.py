"""The narrow decode kernel (float8 "HND_VT" caches: keys on the wgmma's 64-row side, query heads on its narrow
side) against the reference, on the CPU in interpret mode, and through Mosaic GPU's lowering for a GPU."""

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import PAD_SLOT_ID, LayerAttentionParams, paged_attention, reference
from jax_hybrid_attn._compat import interpret_params, races_found
from jax_hybrid_attn.kernels import mixed_batch, narrow_decode
from jax_hybrid_attn.kernels.narrow_decode import narrow_columns
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

FP8 = jnp.float8_e4m3fn
# Key counts straddle the 64-key steps and the 64/128-token blocks, windows and chunks; a request with no context
# beside them would be flagged, so every request holds at least its own token.
CASES = {
    "gqa4-window-sinks": dict(heads=(8, 2), block_size=64, seq_lens=[40, 150, 64], params=dict(sliding_window=24),
                              sinks=True),
    "gqa4-two-tokens-chunk": dict(heads=(8, 2), block_size=64, query_lens=[2, 1, 2], seq_lens=[65, 129, 200],
                                  params=dict(attention_chunk_size=64)),
    "mqa8-softcap-block128": dict(heads=(8, 1), block_size=128, seq_lens=[127, 129, 300],
                                  params=dict(logits_soft_cap=30.0, sm_scale=0.3)),
    "mha-fp16-pair": dict(heads=(2, 2), block_size=64, seq_lens=[1, 64, 190], dtype=jnp.float16, kv_pair=True),
    "gqa5-padded-columns": dict(heads=(10, 2), block_size=64, seq_lens=[33, 100, 257], params=dict(sliding_window=80)),
    "gqa16-non-causal-three-tokens": dict(heads=(16, 1), block_size=64, query_lens=[3, 1, 2], seq_lens=[70, 5, 140],
                                          params=dict(causal=False), sinks=True),
}  # fmt: skip


def run(case, *, seed=0, interpret=True):
    num_q_heads, num_kv_heads = case["heads"]
    seq_lens = case["seq_lens"]
    query_lens = case.get("query_lens", [1] * len(seq_lens))
    params = LayerAttentionParams(**case.get("params", {}))
    inputs = random_paged_inputs(
        seed, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=64, block_size=case["block_size"], dtype=case.get("dtype", jnp.bfloat16), kv_dtype=FP8,
        kv_layout="HND_VT", with_sinks=case.get("sinks", False), causal=params.causal,
        kv_pair=case.get("kv_pair", False), spare_blocks=2,
    )  # fmt: skip
    options = dict(params=params, sinks=inputs.sinks)
    out = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, interpret=interpret, **options)
    expected = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options)
    return np.asarray(out, np.float32), np.asarray(expected, np.float32), inputs


@pytest.fixture
def narrow_launches(monkeypatch):
    """The number of narrow-kernel launches traced in the test (the kernels' jit cache is dropped around it)."""
    launches = []
    launch = narrow_decode.launch_narrow_decode

    def counted(*args, **kwargs):
        launches.append(kwargs["config"])
        return launch(*args, **kwargs)

    monkeypatch.setattr(mixed_batch, "launch_narrow_decode", counted)
    mixed_batch._paged_attention_kernels.clear_cache()
    yield launches
    mixed_batch._paged_attention_kernels.clear_cache()


@pytest.mark.parametrize(
    "name, num_sms",
    [*((name, 1) for name in CASES), ("gqa4-window-sinks", None), ("mqa8-softcap-block128", None)],
)  # fmt: skip
def test_narrow_decode_matches_reference_without_races(name, num_sms, narrow_launches):
    """Decodes (and two- or three-token queries) of 1 to 16 query heads per KV head: C = 8, 16 or 48 columns (G = 5
    leaves padding columns), NaN in the spare blocks, V columns of keys outside a CTA's range zeroed; the sinks, soft
    cap, scale, window, chunk and non-causal masks; float8 q parts from bfloat16 and float16 queries; the cache as one
    array and as the K/V pair. Traced for a GPU of one SM, each CTA runs all of its request's key steps (the
    running maxima rescale what came before); with the default count, 3 requests leave SMs idle and their keys are
    split across CTAs."""
    case = CASES[name]
    if num_sms is None:
        out, expected, _ = run(case, interpret=interpret_params(detect_races=True))
    else:
        with mixed_batch.lowering_for_sms(num_sms):
            out, expected, _ = run(case, interpret=interpret_params(detect_races=True))
    assert len(narrow_launches) == 1
    assert (narrow_launches[0].num_splits == 1) == (num_sms == 1)
    assert not races_found()
    assert np.isfinite(out).all(), "a NaN-filled block was read"
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(case.get("dtype", jnp.bfloat16))])


def test_narrow_and_tile_kernels_agree(monkeypatch):
    """``KernelConfig.narrow_decode=False`` sends the same decodes to the tile kernel; both match the reference and
    each other within the float8 cache's tolerance."""
    case = CASES["gqa4-window-sinks"]
    narrow, expected, _ = run(case)
    original = mixed_batch.kernel_configs
    monkeypatch.setattr(mixed_batch, "kernel_configs", lambda *a, **k: tuple(
        dataclasses.replace(c, narrow_decode=False) for c in original(*a, **k)))  # fmt: skip
    mixed_batch._paged_attention_kernels.clear_cache()
    try:
        tiled, _, _ = run(case)
    finally:
        mixed_batch._paged_attention_kernels.clear_cache()
    tolerance = TOLERANCES[jnp.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(tiled, expected, **tolerance)
    np.testing.assert_allclose(narrow, tiled, **tolerance)


def test_only_short_queries_over_a_transposed_float8_cache_take_the_narrow_kernel(narrow_launches):
    """Lowered for a GPU: a prefill in the batch keeps the tile kernel (a decode and a prefill launch), as does a
    bfloat16 cache; a decode-only batch over an "HND_VT" float8 cache is one narrow launch, for which no kernel plan
    is built (the narrow kernel reads its requests as they are)."""
    def kernels(query_lens, **cache):
        inputs = random_paged_inputs(1, query_lens=query_lens, seq_lens=[40, 150, 64], num_q_heads=8, num_kv_heads=2,
                                     head_dim=64, block_size=64, **cache)  # fmt: skip
        fn = jax.jit(lambda q, c, m: paged_attention(q, c, m, implementation="kernel"))
        text = fn.trace(inputs.q, inputs.kv_cache, inputs.metadata).lower(lowering_platforms=("cuda",)).as_text()
        return len(set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text))), inputs

    transposed_fp8 = dict(kv_dtype=FP8, kv_layout="HND_VT")
    assert kernels([1, 17, 1], **transposed_fp8)[0] == 2 and narrow_launches == []  # 17 > 64 // G tokens
    assert kernels([1, 1, 1])[0] == 1 and narrow_launches == []
    count, inputs = kernels([1, 1, 1], **transposed_fp8)
    assert count == 1 and len(narrow_launches) == 1
    metadata = inputs.metadata.replace(block_ids_in_range=True)
    assert mixed_batch.plan_kernels(metadata, num_q_heads=8, head_dim=64, q_dtype=jnp.bfloat16,
                                    kv_cache=inputs.kv_cache) is None  # fmt: skip


@pytest.mark.parametrize(
    "group_size, max_query_len, columns",
    [(1, 1, 8), (4, 1, 8), (5, 1, 8), (8, 1, 8), (16, 1, 16), (4, 3, 16), (16, 3, 48), (8, 8, 64), (8, 9, None),
     (64, 1, 64), (65, 1, None)],
)  # fmt: skip
def test_narrow_columns(group_size, max_query_len, columns):
    assert narrow_columns(group_size, max_query_len) == columns


@pytest.mark.parametrize("head_dim, block_size", [(128, 64), (256, 128)])
def test_narrow_decode_lowers_for_a_gpu(head_dim, block_size):
    """Through Mosaic GPU's lowering (on this CPU, for a GPU): q's and P's float8 parts as the narrow side of both
    products, P stored transposed from the transposed register layout, the column reductions across warps."""
    inputs = random_paged_inputs(2, query_lens=[1, 1, 1], seq_lens=[200, 330, 300], num_q_heads=8, num_kv_heads=2,
                                 head_dim=head_dim, block_size=block_size, kv_dtype=FP8, kv_layout="HND_VT")  # fmt: skip
    window = LayerAttentionParams(sliding_window=100)
    fn = jax.jit(lambda q, c, m: paged_attention(q, c, m, params=window, implementation="kernel"))
    text = fn.trace(inputs.q, inputs.kv_cache, inputs.metadata).lower(lowering_platforms=("cuda",)).as_text()
    assert len(set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text))) == 1


@pytest.mark.parametrize("options", [dict(block_kv=128), dict(block_kv=128, q_parts=1, p_parts=1)],
                         ids=["two-parts", "one-part"])  # fmt: skip
def test_a_step_over_two_blocks_matches_reference_without_races(options, monkeypatch):
    """``block_kv`` 128 over blocks of 64: each step's K rows come from two blocks, its V^T and P^T in one tile per
    block; the request whose keys end inside a step's first block repeats it (masked, V zeroed) as the second. Also
    with q and P in one float8 part each (``q_parts=1, p_parts=1``)."""
    original = mixed_batch.kernel_configs
    monkeypatch.setattr(mixed_batch, "kernel_configs", lambda *a, **k: tuple(
        dataclasses.replace(c, **options) for c in original(*a, **k)))  # fmt: skip
    mixed_batch._paged_attention_kernels.clear_cache()
    case = dict(CASES["gqa4-window-sinks"], params=dict(sliding_window=100), seq_lens=[40, 250, 129])
    try:
        with mixed_batch.lowering_for_sms(1):
            out, expected, _ = run(case, interpret=interpret_params(detect_races=True))
    finally:
        mixed_batch._paged_attention_kernels.clear_cache()
    assert not races_found()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_each_query_column_scales_its_own_query_into_float8():
    """q's float8 parts are scaled by a power of two per column (query head and token): a request whose queries
    are 2^-12 of another's keeps its precision (scaled by the largest q of the batch, its parts would fall below
    float8's range)."""
    inputs = random_paged_inputs(
        5, query_lens=[1, 1, 1], seq_lens=[40, 150, 64], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=64, kv_dtype=FP8, kv_layout="HND_VT", spare_blocks=2,
    )  # fmt: skip
    magnitudes = jnp.asarray([1.0, 2.0**-12, 2.0**6], jnp.float32)[:, None, None]
    q = (inputs.q.astype(jnp.float32) * magnitudes).astype(inputs.q.dtype)
    params = LayerAttentionParams(sm_scale=2.0**12 / 8)  # the small request's logits stay O(1)
    small = slice(1, 2)
    out = paged_attention(q, inputs.kv_cache, inputs.metadata, params=params, interpret=True)
    expected = reference.paged_attention(q, inputs.kv_cache, inputs.metadata, params=params)
    np.testing.assert_allclose(np.asarray(out[small], np.float32), np.asarray(expected[small], np.float32),
                               **TOLERANCES[jnp.dtype(jnp.bfloat16)])  # fmt: skip


@pytest.mark.parametrize(
    "num_sms, unwritten", [(1, "nan"), (1, "zero"), (None, "nan")], ids=["one-launch", "one-launch-zeroed", "split"]
)  # fmt: skip
def test_padding_and_requests_the_kernel_cannot_serve(num_sms, unwritten):
    """Unsplit, the kernel writes every row of [T, N, H] itself: padding tokens after the last request come out 0,
    and a flagged request's tokens NaN (a query longer than ``max_query_len``, even past the kernel's columns; a
    sequence beyond its block table; a block id outside the pool), the other requests exact; memory the kernel
    leaves unwritten starts as NaN, then as 0, so that a missing write of either shows. Split, the merge does the
    same. No races between the CTAs' row copies."""
    inputs = random_paged_inputs(
        4, query_lens=[1, 3, 1, 2], seq_lens=[40, 150, 64, 90], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=64, kv_dtype=FP8, kv_layout="HND_VT", spare_blocks=2, with_sinks=True,
    )  # fmt: skip
    num_padding = 5
    q = jnp.concatenate([inputs.q, jax.random.normal(jax.random.key(2), (num_padding, *inputs.q.shape[1:]),
                                                     inputs.q.dtype)])  # fmt: skip
    pad = jnp.full((num_padding,), PAD_SLOT_ID, jnp.int32)
    metadata = inputs.metadata.replace(slot_mapping=jnp.concatenate([inputs.metadata.slot_mapping, pad]))
    options = dict(params=LayerAttentionParams(sliding_window=50), sinks=inputs.sinks)
    starts = np.asarray(metadata.query_start_loc)
    capacity = metadata.block_tables.shape[1] * 64
    cases = {
        "servable": (metadata, None),
        "max_query_len below a query": (metadata.replace(max_query_len=2), 1),
        "seq_len beyond the table": (metadata.replace(seq_lens=metadata.seq_lens.at[2].set(capacity + 3)), 2),
        "block id outside the pool": (metadata.replace(block_tables=metadata.block_tables.at[3, 0].set(10**6)), 3),
    }
    want = np.asarray(reference.paged_attention(q, inputs.kv_cache, metadata, **options), np.float32)
    interpret = dataclasses.replace(interpret_params(detect_races=True), uninitialized_memory=unwritten)
    for name, (case, bad) in cases.items():
        with mixed_batch.lowering_for_sms(num_sms) if num_sms else contextlib.nullcontext():
            got = np.asarray(paged_attention(q, inputs.kv_cache, case, interpret=interpret, **options), np.float32)
        assert not races_found(), name
        rows = np.arange(len(got))
        flagged = (rows >= starts[bad]) & (rows < starts[bad + 1]) if bad is not None else rows < 0
        assert np.isnan(got[flagged]).all(), name
        np.testing.assert_array_equal(got[starts[-1]:], 0.0, err_msg=name)
        kept = ~flagged & (rows < starts[-1])
        np.testing.assert_allclose(got[kept], want[kept], **TOLERANCES[jnp.dtype(jnp.bfloat16)], err_msg=name)
