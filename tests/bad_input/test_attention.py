"""Bad input to attention (`paged_attention`, `layer_attention`, `write_kv`, `LayerAttentionParams`, the metadata):
a clear error that names the argument, a flagged (NaN) result where a traced value cannot be checked, what
``checked=True`` adds, and valid numpy and JAX scalars accepted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import LayerAttentionParams, paged_attention, reference, write_kv
from jax_hybrid_attn.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from jax_hybrid_attn.kernels import mixed_batch
from jax_hybrid_attn.testing import random_paged_inputs

from .cases import SMALL, inputs


def test_numpy_scalars_are_valid_and_sizes_beyond_int32_are_refused():
    params = LayerAttentionParams(
        sliding_window=np.int64(4), sm_scale=np.float32(0.3), causal=np.bool_(True), logits_soft_cap=np.float64(30)
    )
    assert params == LayerAttentionParams(sliding_window=4, sm_scale=float(np.float32(0.3)), logits_soft_cap=30.0)
    assert type(params.sliding_window) is int and type(params.causal) is bool
    with pytest.raises(ValueError, match="sliding_window"):
        LayerAttentionParams(sliding_window=2**31)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        LayerAttentionParams(attention_chunk_size=np.int64(2**40))
    with pytest.raises(ValueError, match="causal"):
        LayerAttentionParams(causal="yes")


def test_metadata_bounds_and_scales_as_numpy_or_jax_scalars_are_valid():
    """numpy integers for the metadata's static bounds, a numpy bool for `causal`, a 0-d array for `sm_scale`:
    the same result as Python scalars. Bounds beyond int32 and a traced or boolean `sm_scale` are refused, named."""
    x = inputs()
    want = reference.paged_attention(x.q, x.kv_cache, x.metadata, params=LayerAttentionParams(sm_scale=0.25))
    metadata = x.metadata.replace(max_query_len=np.int64(x.metadata.max_query_len),
                                  max_seq_len=np.int32(x.metadata.max_seq_len), causal=np.bool_(True))  # fmt: skip
    assert type(metadata.max_query_len) is int and type(metadata.causal) is bool
    for scale in (jnp.asarray(0.25), np.asarray(0.25, np.float32)):
        got = reference.paged_attention(x.q, x.kv_cache, metadata, params=LayerAttentionParams(sm_scale=scale))
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for name in ("max_query_len", "max_seq_len"):
        with pytest.raises(ValueError, match=rf"metadata.{name}=9223372036854775808 must be an int in \[0, 2147"):
            reference.paged_attention(x.q, x.kv_cache, x.metadata.replace(**{name: 2**63}))
    with pytest.raises(ValueError, match="sm_scale=Array"):
        LayerAttentionParams(sm_scale=jnp.asarray(True))
    with pytest.raises(ValueError, match="sm_scale=.* must be a concrete number"):
        jax.jit(lambda scale: LayerAttentionParams(sm_scale=scale))(0.25)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(checked="no"), ValueError, "checked"),
        (dict(params=dict(sliding_window=4)), ValueError, "params"),
    ],
)
def test_options_are_checked(kwargs, error, match):
    x = inputs()
    with pytest.raises(error, match=match):
        reference.paged_attention(x.q, x.kv_cache, x.metadata, **kwargs)


def test_arrays_of_another_kind_and_empty_dimensions_name_the_argument():
    x = inputs()
    with pytest.raises(TypeError, match="q must be a jax or numpy array"):
        reference.paged_attention({"q": 1}, x.kv_cache, x.metadata)
    no_kv_heads = jnp.zeros((4, 2, 16, 0, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="kv_cache.shape"):
        reference.paged_attention(x.q, no_kv_heads, x.metadata)
    no_columns = x.metadata.replace(block_tables=jnp.zeros((2, 0), jnp.int32))
    with pytest.raises(ValueError, match="metadata.block_tables.shape"):
        reference.paged_attention(x.q, x.kv_cache, no_columns)


def test_write_kv_refuses_what_it_would_cast_silently():
    cache = jnp.zeros((4, 2, 16, 2, 64), jnp.bfloat16)
    slots = jnp.arange(3, dtype=jnp.int32)
    k = jnp.ones((3, 2, 64), jnp.bfloat16)
    for bad_v, match in ((jnp.ones((3, 2, 64), jnp.int32), "v.dtype"), (k.astype(jnp.float32), "v.dtype")):
        with pytest.raises(ValueError, match=match):
            write_kv(cache, k, bad_v, slots)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, "1", True])
def test_fp8_scales_are_finite_positive_numbers(scale):
    x = random_paged_inputs(0, query_lens=[1], seq_lens=[20], kv_dtype=jnp.float8_e4m3fn, **SMALL)
    with pytest.raises(ValueError, match="k_scale"):
        reference.paged_attention(x.q, x.kv_cache.replace(k_scale=scale, v_scale=1.0), x.metadata)


def test_a_traced_invalid_scale_gives_nan_not_a_wrong_number():
    x = random_paged_inputs(0, query_lens=[1], seq_lens=[20], kv_dtype=jnp.float8_e4m3fn, **SMALL)
    run = jax.jit(lambda s: reference.paged_attention(x.q, x.kv_cache.replace(k_scale=s, v_scale=1.0), x.metadata))
    assert np.isfinite(np.asarray(run(jnp.float32(0.5)), np.float32)).all()
    for bad in (0.0, -1.0, np.inf, np.nan):
        assert np.isnan(np.asarray(run(jnp.float32(bad)), np.float32)).all()


def unservable_cases():
    x = random_paged_inputs(3, query_lens=[1, 40, 5], seq_lens=[30, 60, 33], **SMALL)
    short_bound = x.metadata.replace(max_query_len=8)  # request 1 has 40 queries
    capacity = x.metadata.block_tables.shape[1] * 16
    beyond_table = x.metadata.replace(seq_lens=x.metadata.seq_lens.at[2].set(capacity + 7))
    outside_pool = x.metadata.replace(block_tables=x.metadata.block_tables.at[0, 0].set(x.kv_cache.dims[0] + 3))
    starts = np.asarray(x.metadata.query_start_loc)
    cases = [("max_query_len below a query", short_bound, 1), ("seq_len beyond the table", beyond_table, 2),
             ("block id outside the pool", outside_pool, 0)]  # fmt: skip
    return x, cases, starts


@pytest.mark.parametrize("implementation", ["reference", "kernel", "kernel, decodes unsplit"])
def test_metadata_the_kernels_cannot_serve_gives_nan_for_those_requests_only(implementation, monkeypatch):
    """A static bound below a request's query, a sequence longer than its block table, or a block id outside the
    pool is flagged: that request's tokens are NaN (the kernels read nothing past the table or the pool), the other
    requests are exact. Unsplit, a batch of decodes is one launch that writes every token's output itself."""
    if implementation == "kernel, decodes unsplit":
        monkeypatch.setattr(mixed_batch, "num_sms", lambda: 1)  # one split: splitting fills no idle SM
        implementation = "kernel"
    x, cases, starts = unservable_cases()
    interpret = implementation == "kernel" and jax.default_backend() != "gpu"
    want = reference.paged_attention(x.q, x.kv_cache, x.metadata)
    for name, metadata, bad in cases:
        got = np.asarray(
            paged_attention(x.q, x.kv_cache, metadata, implementation=implementation, interpret=interpret), np.float32
        )
        rows = np.arange(len(got))
        flagged = (rows >= starts[bad]) & (rows < starts[bad + 1])
        assert np.isnan(got[flagged]).all(), name
        np.testing.assert_allclose(got[~flagged], np.asarray(want, np.float32)[~flagged], atol=2e-2, rtol=2e-2)
        with pytest.raises(ValueError):
            paged_attention(x.q, x.kv_cache, metadata, implementation=implementation, interpret=interpret, checked=True)


def test_checked_writes_refuse_a_slot_named_twice_in_one_step():
    x = random_paged_inputs(0, query_lens=[3], seq_lens=[3], **SMALL)
    slots = jnp.asarray([17, 18, 17], jnp.int32)
    with pytest.raises(ValueError, match="slot_mapping writes slots \\[17\\] more than once"):
        write_kv(jnp.array(x.kv_cache.data), x.q[:, :2], x.q[:, 2:], slots, checked=True)
    with pytest.raises(ValueError, match="more than once"):
        paged_attention(x.q, x.kv_cache, x.metadata.replace(slot_mapping=slots), checked=True)


def test_checked_refuses_null_block_reads_and_writes_reads_of_a_block_another_request_writes_and_bad_sinks():
    """What ``checked=True`` promises beyond ids and lengths: no key position a query attends lies in the null
    block (where a window or chunk leaves positions unreachable, the null block there is fine), no slot is in it,
    no request reads a block that this step writes for another one (a shared prefix is read, never written), and
    the sinks are finite."""
    window = LayerAttentionParams(sliding_window=16)
    small = dict(SMALL, block_size=8)
    x = random_paged_inputs(0, query_lens=[1, 3], seq_lens=[40, 19], null_unreachable_for=dict(sliding_window=16),
                            **small)  # fmt: skip
    tables = np.asarray(x.metadata.block_tables)
    assert (tables[0, :3] == NULL_BLOCK_ID).all()  # positions 0-23 are outside the decode's window
    paged_attention(x.q, x.kv_cache, x.metadata, params=window, checked=True)
    with pytest.raises(ValueError, match=r"block_tables\[0\] points key positions 0..39 .* at the null block"):
        paged_attention(x.q, x.kv_cache, x.metadata, checked=True)  # a full-attention layer reads them all
    hidden = tables.copy()
    hidden[1, 1] = NULL_BLOCK_ID  # positions 8-15 of request 1, inside its queries' windows
    with pytest.raises(ValueError, match=r"block_tables\[1\] points key positions .* at the null block"):
        paged_attention(x.q, x.kv_cache, x.metadata.replace(block_tables=jnp.asarray(hidden)), params=window,
                        checked=True)  # fmt: skip
    crossed = tables.copy()
    crossed[0, 4] = tables[1, 2]  # request 0 reads the block that request 1 writes its tokens 16-18 into
    with pytest.raises(ValueError, match=rf"block_tables\[0\] reads block {tables[1, 2]}, which this step writes "
                                         "for request 1"):  # fmt: skip
        paged_attention(x.q, x.kv_cache, x.metadata.replace(block_tables=jnp.asarray(crossed)), params=window,
                        checked=True)  # fmt: skip
    for bad in (np.nan, np.inf):
        sinks = jnp.full(x.q.shape[1], bad, jnp.float32)
        with pytest.raises(ValueError, match=r"sinks=\[.*\] must be finite"):
            paged_attention(x.q, x.kv_cache, x.metadata, params=window, sinks=sinks, checked=True)
    k = x.q[:2, : x.kv_cache.dims[2]]
    with pytest.raises(ValueError, match=r"slot_mapping holds \[3\]: slots of the null block 0"):
        write_kv(x.kv_cache, k, k, jnp.asarray([3, PAD_SLOT_ID], jnp.int32), checked=True)
