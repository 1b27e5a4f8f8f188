"""write_kv: drops pad slots, writes in place (donation), leaves every other slot bit-identical; one array or the
(k_cache, v_cache) pair. The `KVCache` pytree: its layout static, its scales traced and never donated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import PAD_SLOT_ID, KVCache, LayerAttentionParams, get_kv_cache_shape, layer_attention, write_kv
from jax_hybrid_attn.testing import random_paged_inputs

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 4, 2, 8


def random_cache(rng, kv_layout, dtype, **scales) -> KVCache:
    shape = get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_layout=kv_layout)
    return KVCache(jnp.asarray(rng.standard_normal(shape), dtype), kv_layout, **scales)


def as_nhd(cache: KVCache) -> np.ndarray:
    """[B, 2, S, K, H]."""
    return np.stack([np.asarray(half) for half in cache.halves_nhd()], axis=1)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "HND_VT"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_writes_slots_and_nothing_else(kv_layout, dtype):
    rng = np.random.default_rng(0)
    cache = random_cache(rng, kv_layout, dtype)
    before = as_nhd(cache)
    slots = np.array([5, PAD_SLOT_ID, 17, 10, PAD_SLOT_ID, 23], np.int32)  # none in the null block 0
    k = jnp.asarray(rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)), dtype)

    after = as_nhd(write_kv(cache, k, v, jnp.asarray(slots), checked=True))

    expected = before.copy()
    for t, slot in enumerate(slots):
        if slot != PAD_SLOT_ID:
            expected[slot // BLOCK_SIZE, 0, slot % BLOCK_SIZE] = np.asarray(k[t])
            expected[slot // BLOCK_SIZE, 1, slot % BLOCK_SIZE] = np.asarray(v[t])
    np.testing.assert_array_equal(after.view(np.uint8), expected.view(np.uint8))  # bit-identical, NaN-safe
    assert (after != before).any(axis=(1, 3, 4)).sum() == 4, "exactly the four named slots changed"


@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "HND_VT"])
def test_a_kv_pair_gets_the_writes_of_one_array(kv_layout):
    rng = np.random.default_rng(3)
    cache = random_cache(rng, kv_layout, jnp.bfloat16)
    pair = cache.replace(data=(cache.data[:, 0], cache.data[:, 1]))  # [B, S, K, H] ("NHD") or [B, K, S, H]
    slots = jnp.asarray([12, PAD_SLOT_ID, 19, 8], jnp.int32)
    k = jnp.asarray(rng.standard_normal((4, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((4, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    k_after, v_after = write_kv(pair, k, v, slots, checked=True).data
    expected = write_kv(cache, k, v, slots).data
    np.testing.assert_array_equal(np.asarray(k_after).view(np.uint16), np.asarray(expected[:, 0]).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(v_after).view(np.uint16), np.asarray(expected[:, 1]).view(np.uint16))


def test_hnd_vt_stores_each_blocks_v_transposed_and_k_as_hnd():
    """"HND_VT": K where "HND" has it; V of block b, head k at token s and dimension h at ``h * S + s`` of the
    block and head's [S, H] slab."""
    rng = np.random.default_rng(5)
    cache = KVCache(jnp.zeros(get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_layout="HND_VT")),
                    "HND_VT")  # fmt: skip
    k, v = (jnp.asarray(rng.standard_normal((1, NUM_KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    block, s = 3, 2
    data = np.asarray(write_kv(cache, k, v, jnp.asarray([block * BLOCK_SIZE + s], jnp.int32)).data)
    np.testing.assert_array_equal(data[block, 0, :, s], np.asarray(k[0]))
    slabs = data[block, 1].reshape(NUM_KV_HEADS, BLOCK_SIZE * HEAD_DIM)
    np.testing.assert_array_equal(slabs[:, np.arange(HEAD_DIM) * BLOCK_SIZE + s], np.asarray(v[0]))
    assert np.count_nonzero(data) == 2 * NUM_KV_HEADS * HEAD_DIM


def test_updates_the_donated_buffer_in_place_and_returns_the_form_given():
    rng = np.random.default_rng(1)
    cache = random_cache(rng, "NHD", jnp.bfloat16).data  # an "NHD" array alone
    pointer = cache.unsafe_buffer_pointer()
    k = jnp.asarray(rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    new_cache = write_kv(cache, k, k, jnp.asarray([3, PAD_SLOT_ID], jnp.int32))
    assert cache.is_deleted(), "the old cache was donated"
    assert isinstance(new_cache, jax.Array) and new_cache.unsafe_buffer_pointer() == pointer, "updated in place"


def test_the_arrays_are_donated_and_the_scales_are_not():
    rng = np.random.default_rng(5)
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25))
    cache = KVCache(random_cache(rng, "HND", jnp.float32).data.astype(jnp.float8_e4m3fn), "HND", **scales)
    k = jnp.asarray(rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    new_cache = write_kv(cache, k, k, jnp.asarray([3, 6], jnp.int32))
    assert cache.data.is_deleted() and not scales["k_scale"].is_deleted() and not scales["v_scale"].is_deleted()
    assert (new_cache.layout, new_cache.k_scale, new_cache.v_scale) == ("HND", scales["k_scale"], scales["v_scale"])
    again = write_kv(new_cache, k, k, jnp.asarray([7, 8], jnp.int32))  # the same scales serve the next step
    assert np.isfinite(np.asarray(again.data[2].astype(jnp.float32))).all()


def test_a_kv_cache_is_a_pytree_with_a_static_layout_and_traced_scales():
    cache = KVCache(jnp.zeros((2, 2, 4, 1, 8)), "HND", k_scale=0.5, v_scale=jnp.float32(2.0))
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 3 and jax.tree.unflatten(treedef, leaves).layout == "HND"
    traced = []
    jax.jit(lambda c: traced.append((c.layout, type(c.k_scale))) or c.data.sum())(cache)
    assert traced[0][0] == "HND" and issubclass(traced[0][1], jax.core.Tracer)
    assert cache.dims == (2, 1, 4, 8) and cache.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cache.scales()), [0.5, 2.0])
    np.testing.assert_array_equal(np.asarray(KVCache(cache.data, k_scale=jnp.float32(-1.0)).scales()), [np.nan, 1.0])


def test_fp8_cache_stores_scaled_saturated_values():
    rng = np.random.default_rng(2)
    cache = KVCache(random_cache(rng, "NHD", jnp.float32).data.astype(jnp.float8_e4m3fn), k_scale=0.5, v_scale=0.25)
    k = jnp.asarray(rng.uniform(-1, 1, (2, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16).at[0, 0, 0].set(1000.0)
    v = jnp.asarray(rng.uniform(-1, 1, (2, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    after = write_kv(cache, k, v, jnp.asarray([1, 9], jnp.int32)).data
    stored_k = np.asarray(after[0, 0, 1].astype(jnp.float32))
    assert stored_k[0, 0] == 448.0, "saturated at the e4m3 maximum, not NaN"
    np.testing.assert_allclose(stored_k.ravel()[1:], np.asarray(k[0], np.float32).ravel()[1:] / 0.5, rtol=0.07)
    np.testing.assert_allclose(np.asarray(after[2, 1, 1].astype(jnp.float32)), np.asarray(v[1], np.float32) / 0.25, rtol=0.07, atol=1e-2)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "HND_VT"])
def test_layer_attention_on_a_kv_pair_equals_one_array(kv_layout):
    """Write and attend, one jitted call, on the pair and on the one array: the same output and caches."""
    inputs = random_paged_inputs(
        4, query_lens=[1, 6], seq_lens=[9, 14], num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE, dtype=jnp.float32, kv_layout=kv_layout,
    )  # fmt: skip
    rng = np.random.default_rng(4)
    k, v = (jnp.asarray(rng.standard_normal((7, 2, HEAD_DIM)), jnp.float32) for _ in range(2))
    params = LayerAttentionParams(sliding_window=5)
    arrays = inputs.kv_cache.data
    pair = inputs.kv_cache.replace(data=(jnp.array(arrays[:, 0]), jnp.array(arrays[:, 1])))
    out_pair, pair = layer_attention(inputs.q, k, v, pair, inputs.metadata, params=params)
    out, cache = layer_attention(inputs.q, k, v, inputs.kv_cache.replace(data=jnp.array(arrays)), inputs.metadata,
                                 params=params)  # fmt: skip
    (k_cache, v_cache), cache = pair.data, cache.data
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out_pair), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(k_cache), np.asarray(cache[:, 0]))
    np.testing.assert_array_equal(np.asarray(v_cache), np.asarray(cache[:, 1]))


def test_a_dense_forward_with_a_float8_kv_dtype_equals_attention_over_a_float8_cache():
    """`DenseAttention(kv_dtype=float8_e4m3fn)` models what a paged float8 cache computes: one request's prefill
    written by `write_kv` at the layer's scales (some values saturated) and attended by the reference."""
    from jax_hybrid_attn import make_attention_metadata, reference
    from jax_hybrid_attn.models import DenseAttention

    rng = np.random.default_rng(6)
    num_tokens, k_scale, v_scale = 11, jnp.float32(0.04), jnp.float32(0.02)
    q = jnp.asarray(rng.standard_normal((num_tokens, 4, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)) * 4, jnp.float32) for _ in range(2))
    k = k.at[0, 0, 0].set(100.0)  # beyond 448 * k_scale: saturates
    params = LayerAttentionParams(sliding_window=5)
    dense, _ = DenseAttention(num_tokens, kv_dtype=jnp.float8_e4m3fn).attend(
        0, q, k, v, params=params, k_scale=k_scale, v_scale=v_scale
    )
    plain, _ = DenseAttention(num_tokens).attend(0, q, k, v, params=params)
    table = np.arange(1, 1 + -(-num_tokens // BLOCK_SIZE))[None]
    metadata = make_attention_metadata([num_tokens], [num_tokens], table, block_size=BLOCK_SIZE)
    cache = KVCache(jnp.zeros(get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), jnp.float8_e4m3fn),
                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    cache = write_kv(cache, k, v, metadata.slot_mapping)
    paged = reference.paged_attention(q, cache, metadata, params=params)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(paged), atol=2e-5, rtol=2e-5)
    assert np.abs(np.asarray(dense) - np.asarray(plain)).max() > 1e-3, "float8 rounding shows"


def test_the_float8_rounding_of_a_dense_forward_survives_compilation():
    """XLA's GPU compiler drops a convert pair (f32 -> float8 -> f32) as excess precision: the float8 values of
    `DenseAttention(kv_dtype=float8_e4m3fn)` must reach the attention through an optimization barrier."""
    from jax_hybrid_attn.models import DenseAttention

    def attend(q, k, v):
        return DenseAttention(3, kv_dtype=jnp.float8_e4m3fn).attend(0, q, k, v, params=LayerAttentionParams())[0]

    x = jnp.ones((3, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
    text = jax.jit(attend).lower(x, x, x).as_text()
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    assert len(barriers) == 2 and all("f8E4M3FN" in line for line in barriers), barriers
