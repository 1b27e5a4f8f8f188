"""What the bad-input tests share: small valid inputs and an allocator whose whole state can be compared."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import FullAttentionSpec
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager
from jax_hybrid_attn.testing import random_paged_inputs


SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32)
    config = AllocatorConfig(specs=(spec,), num_blocks=16, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8)
    return KVCacheManager(config)


def snapshot(m: KVCacheManager):
    return (
        [np.asarray(x).copy() for x in jax.tree.leaves(m.state)],
        dict(m._slot_of),
        list(m._free_slots),
        dict(m._num_computed),
    )


def assert_same(before, after):
    for a, b in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert before[1:] == after[1:]


def inputs():
    return random_paged_inputs(0, query_lens=[1, 20], seq_lens=[30, 40], **SMALL)
