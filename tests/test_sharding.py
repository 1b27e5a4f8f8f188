"""Attention with heads split over 2, 4 and 8 devices equals the single-device result (8 forced CPU devices), a
float8 cache with its scales included.

XLA's forced host device count must be set before JAX starts, so the check runs in a subprocess.
"""

import subprocess
import sys
import textwrap

import pytest

from .forced_devices import forced_cpu_devices_env

CHECK = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jax_hybrid_attn import KVCache, LayerAttentionParams, layer_attention
    from jax_hybrid_attn.sharding import replicate_kv_heads, sharded_layer_attention
    from jax_hybrid_attn.testing import TOLERANCES, random_paged_inputs

    assert len(jax.devices()) == 8, jax.devices()
    num_devices, num_q_heads, num_kv_heads, layout, float8 = {case}
    inputs = random_paged_inputs(3, query_lens=[1, 9, 4], seq_lens=[20, 9, 37], num_q_heads=num_q_heads,
                                 num_kv_heads=num_kv_heads, head_dim=16, block_size=8, dtype=jnp.float32,
                                 kv_layout=layout, with_sinks=True)
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((14, num_kv_heads, 16)), jnp.float32) for _ in range(2))
    params = LayerAttentionParams(sliding_window=12, logits_soft_cap=20.0)
    options = dict(params=params, sinks=inputs.sinks, implementation="reference")
    head_axis = 3 if layout == "NHD" else 2
    cache = inputs.kv_cache.replace(data=inputs.kv_cache.data.at[0].set(0.0))  # a finite null block compares
    if float8:  # a float8 cache with its scales, the same on every device
        cache = KVCache(cache.data.astype(jnp.float8_e4m3fn), layout, k_scale=0.5, v_scale=jnp.float32(2.0))
    want, want_cache = layer_attention(inputs.q, k, v, cache.replace(data=jnp.array(cache.data)), inputs.metadata,
                                       **options)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("tp",))
    replicated = replicate_kv_heads(jnp.array(cache.data), num_devices=num_devices, axis=head_axis)
    got, got_cache = sharded_layer_attention(
        mesh, "tp", inputs.q, replicate_kv_heads(k, num_devices=num_devices, axis=1),
        replicate_kv_heads(v, num_devices=num_devices, axis=1), cache.replace(data=replicated), inputs.metadata,
        **options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCES[jnp.dtype(jnp.float32)])
    assert (got_cache.layout, got_cache.k_scale) == (want_cache.layout, want_cache.k_scale)
    got_cache, want_cache = got_cache.data, want_cache.data
    copies = got_cache.shape[head_axis] // num_kv_heads
    first_copy = np.take(np.asarray(got_cache), np.arange(0, got_cache.shape[head_axis], copies), axis=head_axis)
    np.testing.assert_array_equal(first_copy.astype(np.float32), np.asarray(want_cache).astype(np.float32))
    assert len(got.sharding.device_set) == num_devices
    print("ok")
    """
)


@pytest.mark.parametrize(
    "case",
    [(2, 8, 8, "NHD", False), (4, 8, 8, "HND", False), (8, 8, 8, "NHD", False), (4, 8, 2, "NHD", False),
     (8, 8, 2, "HND", False), (2, 8, 8, "NHD", True)],
    ids=["tp2", "tp4-hnd", "tp8", "tp4-kv-replicated", "tp8-kv-replicated-hnd", "tp2-float8-scaled"],
)
def test_heads_split_over_devices_equal_one_device(case):
    env = forced_cpu_devices_env(8)
    result = subprocess.run([sys.executable, "-c", CHECK.format(case=case)], env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_kv_heads_must_divide_or_be_divided_by_the_devices():
    from jax_hybrid_attn.sharding import kv_heads_per_device

    assert kv_heads_per_device(8, 4) == 2 and kv_heads_per_device(2, 8) == 1
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        kv_heads_per_device(3, 4)
