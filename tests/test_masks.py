"""Masks checked two ways: against dense matrices built with tril/triu, and against jax.nn.dot_product_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import LayerAttentionParams, local_window_size, masks, window_left
from jax_hybrid_attn._compat import dense_attention

SEQ_LEN = 37
WINDOWS = [None, 1, 2, 5, 16, 36, 37, 100]
CHUNKS = [None, 1, 4, 7, 16, 64]


def dense_expected(seq_len, *, causal, sliding_window, attention_chunk_size):
    """[q, k] allowed matrix from tril/triu and block-diagonal chunks, independent of masks.py."""
    allowed = np.ones((seq_len, seq_len), bool)
    if causal:
        allowed &= np.tril(allowed)
    if sliding_window is not None:
        allowed &= np.triu(np.ones((seq_len, seq_len), bool), k=-(sliding_window - 1))
    if attention_chunk_size is not None:
        chunk_id = np.arange(seq_len) // attention_chunk_size
        allowed &= chunk_id[:, None] == chunk_id[None, :]
    return allowed


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("attention_chunk_size", CHUNKS)
def test_predicate_and_interval_match_dense(causal, sliding_window, attention_chunk_size):
    options = dict(causal=causal, sliding_window=sliding_window, attention_chunk_size=attention_chunk_size)
    q_pos = np.arange(SEQ_LEN)[:, None]
    k_pos = np.arange(SEQ_LEN)[None, :]
    expected = dense_expected(SEQ_LEN, **options)
    params = LayerAttentionParams(**options)
    np.testing.assert_array_equal(masks.attention_mask(q_pos, k_pos, SEQ_LEN, params=params), expected)

    first, last = masks.allowed_key_range(np.arange(SEQ_LEN), SEQ_LEN, params=params)
    from_interval = (np.asarray(first)[:, None] <= k_pos) & (k_pos <= np.asarray(last)[:, None])
    np.testing.assert_array_equal(from_interval, expected)
    assert np.all(np.asarray(first) <= np.arange(SEQ_LEN)), "a query always sees itself"


def test_single_predicates():
    q, k = np.arange(10)[:, None], np.arange(10)[None, :]
    np.testing.assert_array_equal(masks.causal_mask(q, k), np.tril(np.ones((10, 10), bool)))
    np.testing.assert_array_equal(masks.sliding_window_mask(q, k, 3), np.triu(np.ones((10, 10), bool), k=-2))
    np.testing.assert_array_equal(masks.chunked_local_mask(q, k, 5), np.kron(np.eye(2, dtype=bool), np.ones((5, 5), bool)))


def test_masks_trace_under_jit():
    params = LayerAttentionParams(sliding_window=3, attention_chunk_size=4)
    fn = jax.jit(lambda q, k: masks.attention_mask(q, k, 9, params=params))
    np.testing.assert_array_equal(
        fn(jnp.arange(9)[:, None], jnp.arange(9)[None, :]),
        dense_expected(9, causal=True, sliding_window=3, attention_chunk_size=4),
    )


@pytest.mark.parametrize("sliding_window", [None, 1, 3, 8, 20, 40])
def test_matches_jax_dot_product_attention(sliding_window):
    """Our masked softmax over dense inputs equals jax.nn.dot_product_attention(local_window_size=(W-1, 0))."""
    rng = np.random.default_rng(sliding_window or 0)
    seq_len, heads, head_dim = 24, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((1, seq_len, heads, head_dim)), jnp.float32) for _ in range(3))
    expected = dense_attention(q, k, v, scale=0.25, is_causal=True, local_window_size=local_window_size(sliding_window))

    pos = jnp.arange(seq_len)
    allowed = masks.attention_mask(
        pos[:, None], pos[None, :], seq_len, params=LayerAttentionParams(sliding_window=sliding_window)
    )
    logits = jnp.einsum("qnh,knh->nqk", q[0], k[0]) * 0.25
    weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    ours = jnp.einsum("nqk,knh->qnh", weights, v[0])
    np.testing.assert_allclose(ours, expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sliding_window", "left", "local"), [(None, -1, None), (1, 0, (0, 0)), (4096, 4095, (4095, 0))])
def test_edge_converters(sliding_window, left, local):
    assert window_left(sliding_window) == left
    assert local_window_size(sliding_window) == local


@pytest.mark.parametrize("window", [1, 3, 100])
def test_window_value_may_be_traced(window):
    """The window as a traced value, as the kernels read it, masks as the same window in `params`; a traced
    float window is refused by its dtype (a concrete bad window is refused by value: tests/bad_input)."""
    q, k, params = jnp.arange(9)[:, None], jnp.arange(9)[None, :], LayerAttentionParams(sliding_window=window)
    traced_mask = jax.jit(lambda w: masks.attention_mask(q, k, 9, sliding_window=w))(window)
    np.testing.assert_array_equal(traced_mask, masks.attention_mask(q, k, 9, params=params))
    traced_range = jax.jit(lambda w: masks.allowed_key_range(jnp.arange(9), 9, sliding_window=w))(window)
    np.testing.assert_array_equal(traced_range, masks.allowed_key_range(jnp.arange(9), 9, params=params))
    with pytest.raises(ValueError, match=r"sliding_window \(a float32 array of shape \(\)\) must be an int"):
        jax.jit(lambda w: masks.attention_mask(q, k, 9, sliding_window=w))(float(window))
