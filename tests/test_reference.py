"""The reference against an independent float64 computation over contiguous K/V, on a sampled grid."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import LayerAttentionParams, reference
from jax_hybrid_attn.testing import TOLERANCES, pack_paged_inputs, random_paged_inputs

from .oracle import attention_float64
from .sampling import covering_sample

LENGTHS = [1, 3, 17, 99, 513]
AXES = {
    "block_size": [16, 32],
    "heads": [(8, 8), (32, 8), (6, 1)],
    "head_dim": [64, 128, 256],
    "mask": [{}, dict(sliding_window=1), dict(sliding_window=8), dict(sliding_window=64),
             dict(sliding_window=4096), dict(attention_chunk_size=16), dict(attention_chunk_size=64),
             dict(sliding_window=24, attention_chunk_size=64)],
    "logits_soft_cap": [None, 30.0],
    "with_sinks": [False, True],
    "causal": [True, False],
    "dtype": [jnp.bfloat16, jnp.float32],
    "kv_layout": ["NHD", "HND"],
    "kv_pair": [False, True],
}  # fmt: skip
NUM_CASES = 40


def sampled_cases(num_cases, seed=0):
    """Every value of every axis appears at least num_cases // len(values) times, in shuffled company."""
    rng = np.random.default_rng(seed + 1)
    for i, case in enumerate(covering_sample(AXES, num_cases, seed=seed)):
        # A batch mixing decodes and prefills: a few requests, lengths from LENGTHS, some with cached context.
        num_reqs = int(rng.integers(1, 4))
        seq_lens = rng.choice(LENGTHS, num_reqs)
        query_lens = [int(rng.choice([1, s, max(1, s // 3)])) for s in seq_lens]
        case.update(seed=i, seq_lens=[int(s) for s in seq_lens], query_lens=query_lens)
        yield pytest.param(case, id=f"case{i}")


def run_both(inputs, *, mask, logits_soft_cap, causal, sm_scale=None):
    options = dict(mask, logits_soft_cap=logits_soft_cap, causal=causal, sm_scale=sm_scale)
    out = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, params=LayerAttentionParams(**options),
                                    sinks=inputs.sinks, checked=True)  # fmt: skip
    expected = attention_float64(inputs.q.astype(jnp.float32), inputs.keys, inputs.values,
                                 np.diff(inputs.metadata.query_start_loc), sinks=inputs.sinks, **options)  # fmt: skip
    return np.asarray(out.astype(jnp.float32)), expected


@pytest.mark.parametrize("case", list(sampled_cases(NUM_CASES)))
def test_reference_matches_float64(case):
    num_q_heads, num_kv_heads = case["heads"]
    inputs = random_paged_inputs(
        case["seed"], query_lens=case["query_lens"], seq_lens=case["seq_lens"], num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=case["head_dim"], block_size=case["block_size"],
        dtype=case["dtype"], kv_layout=case["kv_layout"], with_sinks=case["with_sinks"], causal=case["causal"],
        null_unreachable_for=case["mask"] if case["causal"] else None, kv_pair=case["kv_pair"],
    )  # fmt: skip
    out, expected = run_both(inputs, mask=case["mask"], logits_soft_cap=case["logits_soft_cap"], causal=case["causal"])
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(case["dtype"])])


@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "HND_VT"])
def test_fp8_cache_with_scales(kv_layout):
    inputs = random_paged_inputs(3, query_lens=[1, 20], seq_lens=[40, 20], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, kv_layout=kv_layout)  # fmt: skip
    assert inputs.kv_cache.layout == kv_layout
    assert inputs.kv_cache.k_scale != 1.0 and inputs.kv_cache.k_scale != inputs.kv_cache.v_scale
    out, expected = run_both(inputs, mask=dict(sliding_window=16), logits_soft_cap=None, causal=True)
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_float16_and_explicit_scale():
    inputs = random_paged_inputs(4, query_lens=[3, 1], seq_lens=[17, 99], num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=jnp.float16)  # fmt: skip
    out, expected = run_both(inputs, mask={}, logits_soft_cap=None, causal=True, sm_scale=0.3)
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.float16)])


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33])
def test_window_equals_full_attention_over_last_w_keys(sliding_window):
    """Metamorphic: a sliding window over a long cache equals full attention over the last W keys."""
    rng = np.random.default_rng(sliding_window)
    seq_lens, num_kv_heads, head_dim = [70, 200, 33], 2, 64
    keys = [rng.standard_normal((s, num_kv_heads, head_dim)) for s in seq_lens]
    values = [rng.standard_normal((s, num_kv_heads, head_dim)) for s in seq_lens]
    q = rng.standard_normal((len(seq_lens), 4, head_dim))
    long = pack_paged_inputs(rng, q, keys, values, [1, 1, 1], block_size=16, dtype=jnp.float32)
    short = pack_paged_inputs(rng, q, [k[-sliding_window:] for k in keys], [v[-sliding_window:] for v in values],
                              [1, 1, 1], block_size=16, dtype=jnp.float32)  # fmt: skip
    windowed = reference.paged_attention(
        long.q, long.kv_cache, long.metadata, params=LayerAttentionParams(sliding_window=sliding_window)
    )
    full = reference.paged_attention(short.q, short.kv_cache, short.metadata)
    np.testing.assert_allclose(windowed, full, **TOLERANCES[jnp.dtype(jnp.float32)])


def test_mixed_batch_equals_its_parts_and_padding_is_zero():
    query_lens, seq_lens = [1, 1, 17, 40], [30, 99, 17, 60]
    whole = random_paged_inputs(5, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=4, num_kv_heads=1,
                                head_dim=64, block_size=16, dtype=jnp.float32)  # fmt: skip
    chunked = LayerAttentionParams(attention_chunk_size=32)
    out = reference.paged_attention(whole.q, whole.kv_cache, whole.metadata, params=chunked)
    starts = np.asarray(whole.metadata.query_start_loc)
    for r in range(len(query_lens)):
        part = whole.metadata.replace(
            query_start_loc=jnp.asarray([0, query_lens[r]], jnp.int32), seq_lens=whole.metadata.seq_lens[r : r + 1],
            block_tables=whole.metadata.block_tables[r : r + 1],
            slot_mapping=whole.metadata.slot_mapping[starts[r] : starts[r + 1]],
            num_actual_tokens=jnp.asarray(query_lens[r], jnp.int32),
        )  # fmt: skip
        alone = reference.paged_attention(whole.q[starts[r] : starts[r + 1]], whole.kv_cache, part, params=chunked)
        np.testing.assert_allclose(out[starts[r] : starts[r + 1]], alone, **TOLERANCES[jnp.dtype(jnp.float32)])

    padded_q = jnp.concatenate([whole.q, jnp.ones((3, *whole.q.shape[1:]), whole.q.dtype)])
    padded = whole.metadata.replace(slot_mapping=jnp.concatenate([whole.metadata.slot_mapping, jnp.full(3, -1, jnp.int32)]))
    padded_out = reference.paged_attention(padded_q, whole.kv_cache, padded, params=chunked)
    np.testing.assert_array_equal(padded_out[:-3], out)
    assert not np.any(padded_out[-3:])


def test_nan_in_unused_blocks_does_not_leak():
    inputs = random_paged_inputs(6, query_lens=[5], seq_lens=[21], num_q_heads=2, num_kv_heads=2, head_dim=64,
                                 block_size=16, dtype=jnp.float32)  # fmt: skip
    cache = np.asarray(inputs.kv_cache.data)
    assert np.isnan(cache[0]).all(), "the null block is NaN-filled"
    assert np.isnan(cache).any(axis=(1, 2, 3, 4)).sum() >= 3, "null, spare and partially used blocks hold NaN"
    out = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata)
    assert np.isfinite(np.asarray(out)).all()


def test_sampler_covers_every_axis_value():
    cases = [p.values[0] for p in sampled_cases(NUM_CASES)]
    for name, values in AXES.items():
        seen = [c[name] for c in cases]
        assert all(any(s == v for s in seen) for v in values), name
    all_lengths = set(itertools.chain.from_iterable(c["seq_lens"] for c in cases))
    assert all_lengths == set(LENGTHS)
    assert any(1 in c["query_lens"] and max(c["query_lens"]) > 1 for c in cases), "some batch mixes decodes and prefills"
