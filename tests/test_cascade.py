"""Cascade attention (a shared prefix once for every query, each request's suffix, merged by log-sum-exp)
against the float64 oracle and the plain reference, on random data over a sampled grid."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_hybrid_attn
from jax_hybrid_attn import LayerAttentionParams, reference
from jax_hybrid_attn.cascade import cascade_attention, split_violations
from jax_hybrid_attn.kernels.mixed_batch import decode_splits, kernel_configs
from jax_hybrid_attn.kernels.tiles import tokens_per_tile
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

from .oracle import attention_float64
from .sampling import covering_sample

AXES = {
    "block_size": [8, 16],
    "heads": [(4, 1), (8, 2), (4, 4)],
    "head_dim": [64, 128],
    "mask": ["none", "window over every request", "window over some", "chunk over every request",
             "chunk over some"],
    "logits_soft_cap": [None, 30.0],
    "with_sinks": [False, True],
    "causal": [True, False],
    "dtype": [jnp.float32, jnp.bfloat16],
    "kv_dtype": [None, jnp.float8_e4m3fn],
    "kv_layout": ["NHD", "HND"],
    "kv_pair": [False, True],
    "prefix_end": ["block edge", "inside a block"],
}  # fmt: skip
NUM_CASES = 16
PREFIX_BLOCKS = (1, 2, 3)


def sampled_cases(num_cases, seed=0):
    """A batch of decodes and chunks of prefill, all after a prefix of 1-3 shared blocks that ends at a block
    edge or inside the next block (which the requests then hold apart, with equal contents)."""
    rng = np.random.default_rng(seed + 1)
    for i, case in enumerate(covering_sample(AXES, num_cases, seed=seed)):
        size = case["block_size"]
        blocks = int(rng.choice(PREFIX_BLOCKS))
        shared = blocks * size + (0 if case["prefix_end"] == "block edge" else int(rng.integers(1, size)))
        num_reqs = int(rng.integers(2, 5))
        query_lens = [int(rng.choice([1, 1, 3, 2 * size + 1])) for _ in range(num_reqs)]
        seq_lens = [max(shared, blocks * size) + q + int(rng.integers(0, 3 * size)) for q in query_lens]
        case.update(seed=i, blocks=blocks, shared=shared, query_lens=query_lens, seq_lens=seq_lens,
                    mask_kind=case["mask"], mask=mask_of(case["mask"], seq_lens))  # fmt: skip
        yield pytest.param(case, id=f"case{i}")


def mask_of(kind: str, seq_lens: list[int]) -> dict:
    """A window or chunk that holds every request's keys, or the first request's only (the split then serves
    the others NaN: its prefix part would need keys past the window or first chunk)."""
    if kind == "none":
        return {}
    reach = max(seq_lens) if kind.endswith("every request") else seq_lens[0]
    return {"sliding_window": reach} if kind.startswith("window") else {"attention_chunk_size": reach}


def inputs_of(case):
    num_q_heads, num_kv_heads = case["heads"]
    return random_paged_inputs(
        case["seed"], query_lens=case["query_lens"], seq_lens=case["seq_lens"], num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=case["head_dim"], block_size=case["block_size"], dtype=case["dtype"],
        kv_dtype=case["kv_dtype"], kv_layout=case["kv_layout"], with_sinks=case["with_sinks"],
        causal=case["causal"], kv_pair=case["kv_pair"], shared_prefix_len=case["shared"],
    )  # fmt: skip


def params_of(case):
    return LayerAttentionParams(**case["mask"], logits_soft_cap=case["logits_soft_cap"], causal=case["causal"])


def attend(inputs, case, *, cascade_blocks=None, **options):
    arguments = dict(params=params_of(case), sinks=inputs.sinks, **options)
    if cascade_blocks is None:
        return reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **arguments)
    return cascade_attention(inputs.q, inputs.kv_cache, inputs.metadata, num_common_prefix_blocks=cascade_blocks,
                             **arguments)  # fmt: skip


@pytest.mark.parametrize("case", list(sampled_cases(NUM_CASES)))
def test_cascade_matches_float64_and_the_reference(case):
    inputs = inputs_of(case)
    tables = np.asarray(inputs.metadata.block_tables)
    assert (tables[:, : case["blocks"]] == tables[:1, : case["blocks"]]).all()
    assert len(set(tables[:, case["blocks"]])) == len(tables), "the block after the prefix is each request's own"
    # by construction every query starts after the shared blocks; a window or chunk over the first request's
    # keys only leaves out the requests with more keys
    broken = np.array([case["mask_kind"].endswith("some") and s > case["seq_lens"][0] for s in case["seq_lens"]])
    np.testing.assert_array_equal(
        split_violations(inputs.metadata, case["blocks"], block_size=case["block_size"], params=params_of(case)), broken
    )
    out = np.asarray(attend(inputs, case, cascade_blocks=case["blocks"], checked=not broken.any()).astype(jnp.float32))
    expected = attention_float64(
        inputs.q.astype(jnp.float32), inputs.keys, inputs.values, np.diff(inputs.metadata.query_start_loc),
        sinks=inputs.sinks, logits_soft_cap=case["logits_soft_cap"], causal=case["causal"], **case["mask"],
    )  # fmt: skip
    served = np.repeat(~broken, np.diff(inputs.metadata.query_start_loc))
    assert np.isnan(out[~served]).all() and np.isfinite(out[served]).all()
    np.testing.assert_allclose(out[served], expected[served], **TOLERANCES[jnp.dtype(case["dtype"])])
    plain = np.asarray(attend(inputs, case).astype(jnp.float32))
    np.testing.assert_allclose(out[served], plain[served], **TOLERANCES[jnp.dtype(case["dtype"])])


def test_sampler_covers_every_axis_value():
    cases = [p.values[0] for p in sampled_cases(NUM_CASES)]
    for name, values in AXES.items():
        for value in values:
            assert any(case["mask_kind" if name == "mask" else name] == value for case in cases), (name, value)
    assert any(c["mask_kind"].endswith("some") and max(c["seq_lens"]) > c["seq_lens"][0] for c in cases), (
        "some case has requests that the split cannot serve")  # fmt: skip


CASE = dict(block_size=8, heads=(4, 1), head_dim=64, mask={}, logits_soft_cap=None, with_sinks=True, causal=True,
            dtype=jnp.float32, kv_dtype=None, kv_layout="NHD", kv_pair=False, seed=7)  # fmt: skip


def test_shared_blocks_are_read_from_the_first_request_only():
    """The prefix part reads the first request's blocks for everyone: other requests' copies never matter."""
    case = dict(CASE, query_lens=[1, 1, 4], seq_lens=[30, 27, 40], shared=24)
    inputs = inputs_of(case)
    tables = np.asarray(inputs.metadata.block_tables)
    own_copy = tables[1, 0]
    assert own_copy == tables[0, 0]
    out = attend(inputs, case, cascade_blocks=3)
    np.testing.assert_allclose(out, attend(inputs, case), **TOLERANCES[jnp.dtype(jnp.float32)])


def test_zero_blocks_is_plain_attention_and_a_traced_count_works():
    case = dict(CASE, query_lens=[1, 3, 1], seq_lens=[20, 25, 17], shared=16)
    inputs = inputs_of(case)
    plain = attend(inputs, case)
    np.testing.assert_allclose(attend(inputs, case, cascade_blocks=0), plain, **TOLERANCES[jnp.dtype(jnp.float32)])
    traced = jax.jit(lambda n: attend(inputs, case, cascade_blocks=n))
    np.testing.assert_allclose(traced(jnp.int32(2)), plain, **TOLERANCES[jnp.dtype(jnp.float32)])


def test_a_request_the_split_cannot_serve_is_nan_and_checked_raises():
    # request 1's query starts inside a 3-block prefix (24 tokens); request 2's third block is its own
    case = dict(CASE, query_lens=[1, 6, 1], seq_lens=[30, 28, 31], shared=16)
    inputs = inputs_of(case)
    tables = np.array(inputs.metadata.block_tables)
    assert tables[2, 2] != tables[0, 2]
    tables[1, 2] = tables[0, 2]  # request 1 holds block 2 alike (its query, from position 22, is inside it)
    inputs = dataclasses.replace(inputs, metadata=inputs.metadata.replace(block_tables=jnp.asarray(tables)))
    np.testing.assert_array_equal(split_violations(inputs.metadata, 3, block_size=8), [False, True, True])
    out = np.asarray(attend(inputs, case, cascade_blocks=3))
    starts = np.asarray(inputs.metadata.query_start_loc)
    assert np.isfinite(out[: starts[1]]).all() and np.isnan(out[starts[1] :]).all()
    with pytest.raises(ValueError, match=r"num_common_prefix_blocks=3 does not split requests \[1, 2\]"):
        attend(inputs, case, cascade_blocks=3, checked=True)
    np.testing.assert_allclose(out[: starts[1]], np.asarray(attend(inputs, case))[: starts[1]],
                               **TOLERANCES[jnp.dtype(jnp.float32)])  # fmt: skip


@pytest.mark.parametrize("blocks", [-1, 9])
def test_a_count_outside_the_tables_is_refused(blocks):
    case = dict(CASE, query_lens=[1, 1], seq_lens=[30, 27], shared=16)
    inputs = inputs_of(case)
    with pytest.raises(ValueError, match=rf"num_common_prefix_blocks={blocks} must be in \[0, 4\]"):
        attend(inputs, case, cascade_blocks=blocks)


KERNEL_CASES = 6


@pytest.mark.parametrize("case", list(sampled_cases(KERNEL_CASES, seed=1)))
def test_cascade_kernels_match_the_reference_twin(case):
    """The kernels (Mosaic GPU interpret mode): the prefix part as one non-causal request of every token, the
    suffix part on shifted tables; the same output and the same NaN rows as the reference's cascade."""
    case = dict(case, dtype=jnp.bfloat16)  # the kernels' query dtypes
    inputs = inputs_of(case)
    out = np.asarray(attend(inputs, case, cascade_blocks=case["blocks"], interpret=True).astype(jnp.float32))
    twin = np.asarray(attend(inputs, case, cascade_blocks=case["blocks"], implementation="reference").astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(twin))
    assert np.isfinite(out[: int(inputs.metadata.query_lens[0])]).all()
    np.testing.assert_allclose(out, twin, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_a_long_prefix_is_split_over_ctas_on_the_kernels():
    """More queries than one decode tile holds make the prefix part a prefill tile; with few tiles its keys are
    split across CTAs (merged per token), and the result stays the reference's."""
    case = dict(CASE, dtype=jnp.bfloat16, block_size=16, head_dim=64, query_lens=[1] * 20,
                seq_lens=[384 + 1 + i % 7 for i in range(20)], shared=384)  # fmt: skip
    inputs = inputs_of(case)
    config = kernel_configs(64, jnp.bfloat16, jnp.bfloat16)[1]
    assert 20 > tokens_per_tile(4) and decode_splits(1, max_key_steps=-(-391 // config.block_kv)) > 1
    out = np.asarray(attend(inputs, case, cascade_blocks=24, interpret=True).astype(jnp.float32))
    twin = np.asarray(attend(inputs, case, cascade_blocks=24, implementation="reference").astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, twin, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_the_kernels_refuse_what_they_do_not_support():
    case = dict(CASE, query_lens=[1, 1], seq_lens=[30, 27], shared=16)
    inputs = inputs_of(case)
    with pytest.raises(NotImplementedError, match="kernel with q.dtype=float32"):
        attend(inputs, case, cascade_blocks=2, implementation="kernel")


@pytest.mark.parametrize("implementation", ["reference", "kernel"])
def test_the_metadata_selects_the_cascade_in_paged_and_layer_attention(implementation):
    """``metadata.num_common_prefix_blocks`` routes `paged_attention` (and `layer_attention`, under jit with the
    count traced) through the cascade: a request that breaks the split comes out NaN there, and only there."""
    case = dict(CASE, dtype=jnp.bfloat16, query_lens=[1, 1, 5], seq_lens=[30, 27, 19], shared=16)
    inputs = inputs_of(case)
    tables = np.array(inputs.metadata.block_tables)
    tables[2, :2] = tables[0, :2]
    metadata = inputs.metadata.replace(block_tables=jnp.asarray(tables), num_common_prefix_blocks=jnp.int32(2))
    options = dict(params=params_of(case), sinks=inputs.sinks, implementation=implementation,
                   interpret=implementation == "kernel")  # fmt: skip
    out = np.asarray(jax_hybrid_attn.paged_attention(inputs.q, inputs.kv_cache, metadata, **options), np.float32)
    starts = np.asarray(metadata.query_start_loc)
    assert np.isnan(out[starts[2] :]).all(), "request 2's query (positions 14-18) starts inside the prefix"
    plain = np.asarray(jax_hybrid_attn.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options), np.float32)
    np.testing.assert_allclose(out[: starts[2]], plain[: starts[2]], **TOLERANCES[jnp.dtype(jnp.bfloat16)])
    layer = jax.jit(lambda m: jax_hybrid_attn.layer_attention(inputs.q, None, None, inputs.kv_cache, m, **options)[0])
    np.testing.assert_array_equal(np.asarray(layer(metadata), np.float32), out)


def test_a_count_of_the_wrong_type_is_refused():
    case = dict(CASE, query_lens=[1, 1], seq_lens=[30, 27], shared=16)
    inputs = inputs_of(case)
    metadata = inputs.metadata.replace(num_common_prefix_blocks=jnp.float32(2))
    with pytest.raises(ValueError, match="metadata.num_common_prefix_blocks"):
        jax_hybrid_attn.paged_attention(inputs.q, inputs.kv_cache, metadata)
