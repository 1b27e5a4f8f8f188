"""The Mosaic GPU kernels against the reference, on the CPU in interpret mode (tiny shapes, sampled grid).

The same cases run at larger shapes on the H200 through benchmarks/paged_attention_h200.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import PAD_SLOT_ID, LayerAttentionParams, paged_attention, reference
from jax_hybrid_attn._compat import interpret_params, races_found
from jax_hybrid_attn.kernels import cta_parts, mixed_batch
from jax_hybrid_attn.kernels.config import KernelConfig
from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

from .sampling import covering_sample

AXES = {
    "block_size": [16, 32, 64],
    "heads": [(4, 4), (8, 2), (6, 1), (16, 2)],
    "mask": [{}, dict(sliding_window=1), dict(sliding_window=8), dict(sliding_window=40),
             dict(sliding_window=4096), dict(attention_chunk_size=64), dict(attention_chunk_size=128)],
    "logits_soft_cap": [None, 30.0],
    "sm_scale": [None, 0.3],
    "with_sinks": [False, True],
    "causal": [True, False],
    "dtype": [jnp.bfloat16, jnp.float16],
    "kv_fp8": [False, True],
    "kv_layout": ["NHD", "HND"],
    "kv_pair": [False, True],
}  # fmt: skip
NUM_CASES = 16
# (query_lens, seq_lens): decodes, speculative verification, prefills with and without cached context,
# lengths straddling blocks (16..64) and chunks (64, 128); a prefill over more key steps than ring slots.
BATCHES = [
    ([1, 1, 1], [1, 65, 130]),
    ([1, 3, 17], [16, 40, 17]),
    ([2, 33, 1], [129, 99, 64]),
    ([1, 70], [200, 330]),
]


def sampled_cases():
    for i, case in enumerate(covering_sample(AXES, NUM_CASES, seed=1)):
        case["batch"] = BATCHES[i % len(BATCHES)]
        yield pytest.param(case, id=f"case{i}")


def run_case(case, *, seed, interpret=True):
    num_q_heads, num_kv_heads = case["heads"]
    query_lens, seq_lens = case["batch"]
    inputs = random_paged_inputs(
        seed, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=64, block_size=case["block_size"], dtype=case["dtype"], kv_layout=case["kv_layout"],
        kv_dtype=jnp.float8_e4m3fn if case["kv_fp8"] else None,
        with_sinks=case["with_sinks"], causal=case["causal"],
        null_unreachable_for=case["mask"] if case["causal"] else None, kv_pair=case.get("kv_pair", False),
    )  # fmt: skip
    params = LayerAttentionParams(**case["mask"], logits_soft_cap=case["logits_soft_cap"], sm_scale=case.get("sm_scale"),
                                  causal=case["causal"])  # fmt: skip
    options = dict(params=params, sinks=inputs.sinks)
    out = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, interpret=interpret, **options)
    expected = reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options)
    return np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32))


@pytest.mark.parametrize("case", list(sampled_cases()))
def test_kernel_matches_reference(case):
    out, expected = run_case(case, seed=7)
    assert np.isfinite(out).all(), "a NaN-filled block was read"
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(case["dtype"])])


@pytest.fixture
def kernel_options(monkeypatch):
    """``kernel_options(**options)``: both kernels (decode and prefill) with these `KernelConfig` options for the
    rest of the test. The kernels' compiled calls hold the options they were traced with: they are dropped when the
    options change and when the test ends, so that no other test runs them."""
    original = mixed_batch.kernel_configs

    def use(**options):
        def replaced(*args, **kwargs):
            return tuple(dataclasses.replace(c, **options) for c in original(*args, **kwargs))

        monkeypatch.setattr(mixed_batch, "kernel_configs", replaced)
        mixed_batch._paged_attention_kernels.clear_cache()

    yield use
    mixed_batch._paged_attention_kernels.clear_cache()


def test_no_races_detected():
    """A decode tile (producer + one consumer) and prefill tiles (producer + two consumers), edge steps
    with V rows zeroed by consumer 0 for both (a bf16 cache; a float8 one's staging buffers: the first case
    of `test_float8_cache_matches_reference_without_races`, the same batch). The last request's keys
    (107..149) span two key steps of 128, both edge steps: consumer 0 zeroes two slots in a row."""
    case = dict(block_size=16, heads=(8, 2), mask=dict(sliding_window=24), logits_soft_cap=None, with_sinks=True,
                causal=True, dtype=jnp.bfloat16, kv_fp8=False, kv_layout="NHD",
                batch=([1, 20, 20], [40, 33, 150]))  # fmt: skip
    out, expected = run_case(case, seed=3, interpret=interpret_params(detect_races=True))
    assert not races_found()
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


WINDOW_SINKS = dict(heads=(8, 2), mask=dict(sliding_window=24), logits_soft_cap=None, with_sinks=True, causal=True,
                    dtype=jnp.bfloat16, kv_fp8=True, batch=([1, 20, 20], [40, 33, 150]))  # fmt: skip
CHUNK_SOFTCAP_PAIR = dict(heads=(4, 4), mask=dict(attention_chunk_size=64), logits_soft_cap=30.0, with_sinks=False,
                          causal=True, dtype=jnp.float16, kv_fp8=True, kv_pair=True, batch=([1, 70], [200, 330]))  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        dict(WINDOW_SINKS, block_size=16, kv_layout="NHD"),
        dict(CHUNK_SOFTCAP_PAIR, block_size=32, kv_layout="HND"),
        dict(WINDOW_SINKS, block_size=64, kv_layout="HND_VT"),
        dict(CHUNK_SOFTCAP_PAIR, block_size=256, kv_layout="HND_VT"),
    ],
    ids=["bf16-q-window-sinks", "fp16-q-chunk-softcap-hnd-pair", "v-transposed-bf16-q-window-sinks-block64",
         "v-transposed-fp16-q-chunk-softcap-pair-block256"],
)  # fmt: skip
def test_float8_cache_matches_reference_without_races(case):
    """A float8 cache: QK on float8 tensor cores from the K ring (q in two float8 parts), in decode tiles and
    two-consumer prefill tiles, without races between the warpgroups. V staged in float16 ("NHD", "HND"), or
    ("HND_VT") V's transposed blocks copied by TMA into the ring and read there by the float8 PV product (P in two
    float8 parts), foreign V columns zeroed on edge steps (by consumer 0 for both consumers of a prefill tile), in
    blocks of one step and of two (steps of 128 keys within blocks of 256)."""
    out, expected = run_case(case, seed=3, interpret=interpret_params(detect_races=True))
    assert not races_found()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(case["dtype"])])


def test_mixed_batch_equals_its_parts():
    query_lens, seq_lens = [1, 2, 40], [50, 77, 60]
    inputs = random_paged_inputs(11, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    window = LayerAttentionParams(sliding_window=30)
    whole = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, params=window, interpret=True)
    starts = np.asarray(inputs.metadata.query_start_loc)
    for r, query_len in enumerate(query_lens):
        part = inputs.metadata.replace(
            query_start_loc=jnp.asarray([0, query_len], jnp.int32), seq_lens=inputs.metadata.seq_lens[r : r + 1],
            block_tables=inputs.metadata.block_tables[r : r + 1],
            slot_mapping=inputs.metadata.slot_mapping[starts[r] : starts[r + 1]],
            num_actual_tokens=jnp.asarray(query_len, jnp.int32), max_query_len=query_len,
        )  # fmt: skip
        alone = paged_attention(inputs.q[starts[r] : starts[r + 1]], inputs.kv_cache, part, params=window, interpret=True)
        np.testing.assert_allclose(np.asarray(whole[starts[r] : starts[r + 1]], np.float32), np.asarray(alone, np.float32),
                                   **TOLERANCES[jnp.dtype(jnp.bfloat16)])  # fmt: skip


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1], [50, 17, 64]), ([1, 2, 40], [50, 77, 60])],
                         ids=["decodes", "mixed"])  # fmt: skip
def test_a_launch_planned_once_for_the_step_gives_the_layers_outputs(query_lens, seq_lens):
    """`plan_kernels` builds the launch's requests and tiles once (from another layer's block tables: the plan
    holds none); a layer's call with it as ``metadata.kernel_plan`` gives the unplanned call's output bit for bit.
    A plan of another shape, or for metadata that does not vouch for its block ids, is refused."""
    inputs = random_paged_inputs(12, query_lens=query_lens, seq_lens=seq_lens, num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    metadata = inputs.metadata.replace(block_ids_in_range=True)
    window = LayerAttentionParams(sliding_window=30)
    other_layer = metadata.replace(block_tables=jnp.zeros_like(metadata.block_tables))
    plan = mixed_batch.plan_kernels(other_layer, num_q_heads=8, head_dim=64, q_dtype=jnp.bfloat16,
                                    kv_cache=inputs.kv_cache)  # fmt: skip
    assert isinstance(plan, mixed_batch.KernelPlan)
    unplanned = paged_attention(inputs.q, inputs.kv_cache, metadata, params=window, interpret=True)
    planned = paged_attention(inputs.q, inputs.kv_cache, metadata.replace(kernel_plan=plan), params=window,
                              interpret=True)  # fmt: skip
    assert np.isfinite(np.asarray(unplanned[: sum(query_lens)], np.float32)).all()
    np.testing.assert_array_equal(np.asarray(planned, np.float32), np.asarray(unplanned, np.float32))
    assert mixed_batch.plan_kernels(inputs.metadata, num_q_heads=8, head_dim=64, q_dtype=jnp.bfloat16,
                                    kv_cache=inputs.kv_cache) is None  # fmt: skip
    with pytest.raises(ValueError, match=r"kernel_plan was built for another call: \{'group_size': \(4, 2\)"):
        paged_attention(inputs.q[:, :4], inputs.kv_cache, metadata.replace(kernel_plan=plan), params=window,
                        interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="metadata.kernel_plan must be a KernelPlan"):
        paged_attention(inputs.q, inputs.kv_cache, metadata.replace(kernel_plan=plan.tiles), params=window,
                        interpret=True)  # fmt: skip


@pytest.mark.parametrize("kv_pair", [False, True])
def test_blocks_larger_than_a_kernel_step(kv_pair):
    """S = 256 (transformers' continuous batching default): each step reads ``block_kv`` rows of one block."""
    case = dict(block_size=256, heads=(4, 2), mask=dict(sliding_window=200), logits_soft_cap=None, with_sinks=False,
                causal=True, dtype=jnp.bfloat16, kv_fp8=False, kv_layout="NHD", kv_pair=kv_pair,
                batch=([1, 130, 1], [300, 260, 513]))  # fmt: skip
    out, expected = run_case(case, seed=5)
    assert np.isfinite(out).all(), "a NaN-filled block was read"
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])


@pytest.mark.parametrize(
    "case",
    [
        dict(block_size=16, heads=(8, 2), mask=dict(sliding_window=40), logits_soft_cap=None, sm_scale=0.3,
             with_sinks=True, causal=True, dtype=jnp.bfloat16, kv_fp8=False, kv_layout="NHD",
             batch=([2, 33, 1], [129, 99, 64])),
        dict(block_size=32, heads=(4, 4), mask=dict(attention_chunk_size=64), logits_soft_cap=30.0,
             with_sinks=False, causal=True, dtype=jnp.float16, kv_fp8=True, kv_layout="HND", kv_pair=True,
             batch=([1, 70], [200, 330])),
        dict(block_size=64, heads=(4, 2), mask={}, logits_soft_cap=None, with_sinks=False, causal=False,
             dtype=jnp.bfloat16, kv_fp8=False, kv_layout="NHD", batch=([3, 70], [300, 330])),
    ],
    ids=["window-sinks-scale", "chunk-softcap-fp8-pair", "non-causal"],
)  # fmt: skip
def test_edge_steps_and_more_key_steps_than_ring_slots_match_reference(case):
    """Masked edge steps at both ends, a prefill over more key steps than ring slots."""
    out, expected = run_case(case, seed=11)
    assert np.isfinite(out).all(), "a NaN-filled block was read"
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(case["dtype"])])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(dtype=jnp.float32), "float32"),
        (dict(head_dim=32), "head_dim"),
        (dict(block_size=48), "block_size"),  # neither divides block_kv nor is a multiple of it
        (dict(kv_layout="HND_VT", block_size=64), "'HND_VT' and kv_cache.dtype=bfloat16"),  # float8 only
        (dict(kv_layout="HND_VT", kv_dtype=jnp.float8_e4m3fn, block_size=32), "'HND_VT' and block_size=32"),
    ],
)
def test_unsupported_combinations_raise(change, message):
    kwargs = dict(query_lens=[1], seq_lens=[20], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                  dtype=jnp.bfloat16) | change  # fmt: skip
    inputs = random_paged_inputs(0, **kwargs)
    with pytest.raises(NotImplementedError, match=message):
        paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, implementation="kernel")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(block_kv=100), "block_kv=100"),
        (dict(num_stages=0), "num_stages=0"),
        (dict(num_consumers=3), "num_consumers=3"),
        (dict(consumer_registers=236), "consumer_registers=236"),
        (dict(producer_registers=16), "producer_registers=16"),
        (dict(num_consumers=2, consumer_registers=232, producer_registers=48), "3 x 168 registers"),
    ],
)
def test_kernel_config_rejects_bad_values(options, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**options)


@pytest.mark.parametrize("magnitude", [1e-12, 1.0, 3.0e5, 1e30])
def test_float16_query_is_exact_and_in_range(magnitude):
    q = (jax.random.normal(jax.random.key(0), (5, 4, 64)) * magnitude).astype(jnp.bfloat16)
    scale = mixed_batch.float16_query_scale(q)
    q16, factor = mixed_batch.float16_query(q, scale), 1 / scale
    assert q16.dtype == jnp.float16
    largest = float(jnp.abs(q16.astype(jnp.float32)).max())
    assert 2.0**cta_parts.QUERY_EXPONENT <= largest < 2.0 ** (cta_parts.QUERY_EXPONENT + 1)
    # bfloat16 values scaled by a power of two fit float16 exactly while they stay above its normal range
    normal = jnp.abs(q16.astype(jnp.float32)) >= 2.0**-14
    np.testing.assert_array_equal(
        np.where(normal, q16.astype(jnp.float32) * factor, 0), np.where(normal, q.astype(jnp.float32), 0)
    )


def test_float16_query_passes_nonfinite_and_zero_through():
    q = jnp.zeros((2, 1, 64), jnp.bfloat16)
    assert float(mixed_batch.float16_query_scale(q)) == 1.0 and not mixed_batch.float16_query(q, 1.0).any()
    q = q.at[0, 0, 3].set(jnp.nan)
    scale = mixed_batch.float16_query_scale(q)
    assert float(scale) == 1.0 and bool(jnp.isnan(mixed_batch.float16_query(q, scale)[0, 0, 3]))


def test_a_config_beyond_shared_memory_raises(kernel_options):
    """head_dim 256 fits two consumers with a ring of two 128-key stages, not with four."""
    kernel_options(num_stages=4)
    inputs = random_paged_inputs(0, query_lens=[40], seq_lens=[40], num_q_heads=2, num_kv_heads=1, head_dim=256,
                                 block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    with pytest.raises(NotImplementedError, match="bytes of shared memory"):
        paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, implementation="kernel")


@pytest.mark.parametrize(
    ("ctas", "max_key_steps", "splits"),
    [(512, 64, 1), (256, 64, 1), (132, 64, 1), (64, 64, 2), (40, 64, 3), (300, 64, 2), (1, 64, 15), (1, 4, 4),
     (40, 2, 2), (1, 1, 1), (1, 0, 1)],
)  # fmt: skip
def test_decode_splits_fill_idle_sms_only(ctas, max_key_steps, splits):
    """Whole waves are not split (512 CTAs on an H200's 132 SMs: 3.9 waves either way); a launch leaving SMs idle
    is, with the fewest splits within `SPLIT_SLACK` of the best (64 CTAs: 2 splits halve the time, more gain
    nothing), and never more splits than key steps."""
    with mixed_batch.lowering_for_sms(132):
        assert mixed_batch.decode_splits(ctas, max_key_steps=max_key_steps) == splits


def test_the_sm_count_comes_from_the_gpu_or_from_the_process_that_lowers_for_it():
    gpu = jax.default_backend() == "gpu"
    native = mixed_batch.num_sms()
    assert native == (jax.devices()[0].core_count if gpu else mixed_batch.FALLBACK_NUM_SMS)
    with mixed_batch.lowering_for_sms(114):  # an H100 PCIe: 57 CTAs fill half of it, and 2 splits all of it
        assert mixed_batch.num_sms() == 114 and mixed_batch.decode_splits(57) == 2
    with mixed_batch.lowering_for_sms(132):  # on 132 SMs, 9 splits fill 4 waves almost whole
        assert mixed_batch.decode_splits(57) == 9
    assert mixed_batch.num_sms() == native
    with pytest.raises(ValueError, match="count=0 must be a positive int"), mixed_batch.lowering_for_sms(0):
        pass


def test_cpu_default_is_the_reference():
    inputs = random_paged_inputs(0, query_lens=[2], seq_lens=[20], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                 block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    np.testing.assert_array_equal(paged_attention(inputs.q, inputs.kv_cache, inputs.metadata),
                                  reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata))  # fmt: skip


def test_interpret_mode_refuses_a_small_cpu_thread_pool(monkeypatch):
    inputs = random_paged_inputs(0, query_lens=[1], seq_lens=[20], num_q_heads=2, num_kv_heads=1, head_dim=64,
                                 block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    monkeypatch.setenv("PJRT_NPROC", "2")
    with pytest.raises(RuntimeError, match="PJRT_NPROC"):
        paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, interpret=True)



def _loops_outside_kernels(jaxpr) -> tuple[list[str], int]:
    """The `scan`s and `while`s of `jaxpr` outside the Pallas kernels (`mpmd_map`), with where they were traced,
    and the number of kernels."""
    loops, kernels = [], 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            loops.append(f"{eqn.primitive.name}: {eqn.source_info.traceback}")
        if eqn.primitive.name == "mpmd_map":
            kernels += 1
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    inner_loops, inner_kernels = _loops_outside_kernels(sub)
                    loops, kernels = loops + inner_loops, kernels + inner_kernels
    return loops, kernels


@pytest.mark.parametrize(("query_lens", "launches"), [([1, 1, 1], 1), ([1, 3, 40], 2)], ids=["decodes", "mixed"])
def test_the_wrapper_around_the_kernels_has_no_loop(query_lens, launches):
    """On a GPU each step of a loop is a launch of its own (a binary search over the requests would be log2(R)
    launches per layer): the packing and merging around the kernels is loop-free."""
    inputs = random_paged_inputs(0, query_lens=query_lens, seq_lens=[40, 20, 60], num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    jaxpr = jax.make_jaxpr(lambda q, c, m: paged_attention(q, c, m, interpret=True))(
        inputs.q, inputs.kv_cache, inputs.metadata
    )
    assert _loops_outside_kernels(jaxpr.jaxpr) == ([], launches)


@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["in-kernel-rows", "packed-rows"])
@pytest.mark.parametrize(
    "query_lens", [[1, 45, 37], [1, 3, 1, 2]], ids=["prefills", "decodes-unsplit"]
)  # fmt: skip
def test_padding_tokens_are_zero_and_a_last_request_may_end_at_the_last_token(heads, query_lens, monkeypatch):
    """With G = 4 the prefill tiles (and a batch of decodes that are not split, forced here) read q and write their
    output rows in [T, N, H] themselves, in exact pieces: a last request that ends at the array's last token (no
    copy may run past it), then the same batch with padding tokens after it, which come out 0. For G = 6 the rows go
    through packed tiles and a gather instead. No races between the copies."""
    monkeypatch.setattr(mixed_batch, "num_sms", lambda: 1)  # one split whatever the batch: splitting fills no idle SM
    num_q_heads, num_kv_heads = heads
    inputs = random_paged_inputs(7, query_lens=query_lens, seq_lens=[30, 60, 37, 90][: len(query_lens)],
                                 num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=16,
                                 dtype=jnp.bfloat16, with_sinks=True)  # fmt: skip
    options = dict(params=LayerAttentionParams(sliding_window=20), sinks=inputs.sinks)
    expected = np.asarray(reference.paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, **options), np.float32)
    interpret = interpret_params(detect_races=True)
    out = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, interpret=interpret, **options)
    assert not races_found()
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])

    num_padding = 11
    padding = jax.random.normal(jax.random.key(1), (num_padding, *inputs.q.shape[1:]), inputs.q.dtype)
    metadata = inputs.metadata.replace(
        slot_mapping=jnp.concatenate([inputs.metadata.slot_mapping, jnp.full((num_padding,), PAD_SLOT_ID, jnp.int32)])
    )
    out = paged_attention(jnp.concatenate([inputs.q, padding]), inputs.kv_cache, metadata, interpret=True, **options)
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out[: len(expected)], expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])
    np.testing.assert_array_equal(out[len(expected) :], 0.0)


def _kernel_hashes(q, kv_cache, metadata, params) -> set[str]:
    """The Mosaic GPU kernels (their hashes) that `paged_attention` lowers to for a GPU, lowered on this CPU."""
    fn = jax.jit(lambda q, c, m: paged_attention(q, c, m, params=params, implementation="kernel"))
    text = fn.trace(q, kv_cache, metadata).lower(lowering_platforms=("cuda",)).as_text()
    return set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text))


def test_steps_under_one_token_budget_and_layers_of_any_window_share_their_kernels():
    """Kernels are compiled once per process for each distinct module. Two steps of different T lower to the same
    kernels where the prefill tiles' rows are packed (G = 6 here), their tile tables sized for `token_budget`;
    layers that differ in their window and scale only share theirs too (the window is data). The budget changes
    no result (compared on the CPU, interpret mode)."""
    window = LayerAttentionParams(sliding_window=20)
    steps = []
    for num_padding in (0, 37):
        inputs = random_paged_inputs(5, query_lens=[1, 45, 37], seq_lens=[30, 60, 90], num_q_heads=6, num_kv_heads=1,
                                     head_dim=64, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
        pad = jnp.full((num_padding,), PAD_SLOT_ID, jnp.int32)
        metadata = inputs.metadata.replace(slot_mapping=jnp.concatenate([inputs.metadata.slot_mapping, pad]),
                                           token_budget=128)  # fmt: skip
        q = jnp.concatenate([inputs.q, jnp.ones((num_padding, *inputs.q.shape[1:]), inputs.q.dtype)])
        steps.append((q, inputs.kv_cache, metadata))
    small = _kernel_hashes(*steps[0], window)
    assert len(small) == 2  # a decode and a prefill launch
    assert _kernel_hashes(*steps[1], LayerAttentionParams(sm_scale=0.2)) == small

    q, kv_cache, metadata = steps[1]
    options = dict(params=window, interpret=True)
    budgeted = paged_attention(q, kv_cache, metadata, **options)
    exact = paged_attention(q, kv_cache, metadata.replace(token_budget=None), **options)
    np.testing.assert_array_equal(np.asarray(budgeted, np.float32), np.asarray(exact, np.float32))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_float8_kernels_with_v_transposed_lower_for_a_gpu(head_dim):
    """The "HND_VT" path through Mosaic GPU's lowering (on this CPU, for a GPU): the float8 PV product's operands
    (V's ring, P's parts) have layouts that its wgmma takes, in a decode and a prefill launch."""
    inputs = random_paged_inputs(2, query_lens=[1, 1, 70], seq_lens=[200, 330, 300], num_q_heads=8, num_kv_heads=2,
                                 head_dim=head_dim, block_size=64, kv_dtype=jnp.float8_e4m3fn,
                                 kv_layout="HND_VT")  # fmt: skip
    window = LayerAttentionParams(sliding_window=100)
    assert len(_kernel_hashes(inputs.q, inputs.kv_cache, inputs.metadata, window)) == 2  # a decode and a prefill launch


def test_a_token_budget_below_the_step_is_refused():
    inputs = random_paged_inputs(0, query_lens=[1, 20], seq_lens=[10, 30], num_q_heads=4, num_kv_heads=2,
                                 head_dim=64, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="token_budget=8 must be None or an int >= T=21"):
        paged_attention(inputs.q, inputs.kv_cache, inputs.metadata.replace(token_budget=8), interpret=True)


def test_q_and_p_in_one_float8_part_match_reference_without_races(monkeypatch):
    """``KernelConfig.q_parts=1, p_parts=1``: q and (V transposed) P in one float8 part each for the QK and PV
    products, FlashAttention-3's precision, instead of two, in decode and prefill tiles, within the float8 cache's
    tolerance."""
    default_configs = mixed_batch.kernel_configs

    def one_part(*args, **kwargs):
        return tuple(dataclasses.replace(config, q_parts=1, p_parts=1) for config in default_configs(*args, **kwargs))

    monkeypatch.setattr(mixed_batch, "kernel_configs", one_part)
    mixed_batch._paged_attention_kernels.clear_cache()  # its executables hold the configurations they traced
    try:
        out, expected = run_case(dict(WINDOW_SINKS, block_size=64, kv_layout="HND_VT"), seed=3,
                                 interpret=interpret_params(detect_races=True))  # fmt: skip
    finally:
        mixed_batch._paged_attention_kernels.clear_cache()
    assert not races_found()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, **TOLERANCES[jnp.dtype(jnp.bfloat16)])
