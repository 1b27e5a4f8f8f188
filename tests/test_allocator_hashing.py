"""Chained block hashes: 64 bits from uint32 arithmetic (no x64), stable across runs and processes."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn.allocator import cache_salt_words, prefix_map
from jax_hybrid_attn.allocator.hashing import chain_block_hash, hash_words, root_hash

# Pinned values: a change of the hash function invalidates persisted caches and must be deliberate.
GOLDEN_ROOT = [0x6ED866EB, 0x40662D88]
PROGRAM = (
    "import jax.numpy as jnp, numpy as np;"
    "from jax_hybrid_attn.allocator.hashing import chain_block_hash, root_hash;"
    "r = root_hash(jnp.zeros(2, jnp.uint32));"
    "h = chain_block_hash(r, jnp.arange(16), jnp.int32(0));"
    "print(np.asarray(r).tolist(), np.asarray(h).tolist())"
)


def block_hash(tokens, parent=None, adapter=0):
    parent = root_hash(jnp.zeros(2, jnp.uint32)) if parent is None else parent
    return chain_block_hash(parent, jnp.asarray(tokens, jnp.int32), jnp.int32(adapter))


def test_hashes_are_two_uint32_words_without_x64():
    assert not jax.config.jax_enable_x64
    h = block_hash(range(16))
    assert h.shape == (2,) and h.dtype == jnp.uint32


def test_hash_is_stable_across_processes():
    runs = [
        subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    root = np.asarray(root_hash(jnp.zeros(2, jnp.uint32))).tolist()
    assert runs[0].startswith(str(root))
    assert root == GOLDEN_ROOT


def test_hash_chains_parent_tokens_and_extra_keys():
    first = block_hash(range(16))
    second = block_hash(range(16, 32), parent=first)
    other_parent = block_hash(range(16, 32), parent=block_hash([0] * 16))
    assert not np.array_equal(second, other_parent)  # same tokens, different prefix
    assert not np.array_equal(block_hash(range(16), adapter=1), first)  # adapter (LoRA) id
    salted = chain_block_hash(
        root_hash(jnp.asarray(cache_salt_words("tenant-a"))), jnp.arange(16), jnp.int32(0)
    )
    assert not np.array_equal(salted, first)
    assert np.array_equal(cache_salt_words(None), [0, 0]) and np.array_equal(
        cache_salt_words("x"), cache_salt_words("x")
    )


def test_single_token_changes_flip_about_half_of_the_64_bits():
    base = np.asarray(hash_words(jnp.zeros((1, 20), jnp.uint32)))[0]
    words = (
        jnp.zeros((640, 20), jnp.uint32)
        .at[jnp.arange(640), jnp.arange(640) % 20]
        .set(jnp.uint32(1) << (jnp.arange(640) // 20).astype(jnp.uint32))
    )
    hashes = np.asarray(hash_words(words))
    flipped = np.unpackbits((hashes ^ base).view(np.uint8), axis=1).sum(axis=1)
    assert 28 < flipped.mean() < 36 and flipped.min() > 12
    assert len({tuple(h) for h in hashes.tolist()}) == 640


def test_colliding_prefix_map_inserts_are_placed_in_event_order_on_every_device():
    """Inserts that pick one slot: the earliest wins, the others take the next free slots in later rounds, so
    the table does not depend on which write a device's scatter keeps."""
    table = jnp.full((1, prefix_map.BUCKET_WIDTH + 1), prefix_map.EMPTY_SLOT, jnp.int32).at[:, -1].set(0)
    blocks = jnp.array([7, 3, 9], jnp.int32)
    keys = jnp.array([[1, 2], [3, 4], [5, 6]], jnp.uint32)
    table, inserts = prefix_map.insert(table, blocks, keys, jnp.zeros(3, jnp.int32), jnp.ones(3, bool))
    assert inserts.slot_of.tolist() == [0, 1, 2]
    assert table[0, :3].tolist() == [7, 3, 9]
    assert int(table[0, -1]) == 0b111
