"""Metadata helpers: vLLM's local-attention virtual batches, decode/prefill split and reorder, block-table
expansion, slot mapping, and the metadata pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_hybrid_attn import (
    PAD_SLOT_ID,
    AttentionMetadata,
    LayerAttentionParams,
    expand_block_tables,
    make_attention_metadata,
    make_local_attention_virtual_batches,
    reorder_decodes_first,
    split_decodes_and_prefills,
)
from jax_hybrid_attn.reference import paged_attention
from jax_hybrid_attn.testing import random_paged_inputs

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=8)
TOL = dict(rtol=1e-5, atol=1e-5)


def random_inputs(query_lens, seq_lens, block_size, seed=0, **kwargs):
    return random_paged_inputs(
        seed, query_lens=query_lens, seq_lens=seq_lens, block_size=block_size, dtype=jnp.float32, **HEADS, **kwargs
    )


def metadata_for(query_lens, seq_lens, block_size, **kwargs):
    """Metadata over a random table of distinct block ids, exactly as wide as the longest request needs."""
    num_cols = max(1, -(-max(seq_lens, default=0) // block_size))
    ids = np.random.default_rng(len(query_lens)).permutation(len(seq_lens) * num_cols) + 1
    table = ids.reshape(len(seq_lens), num_cols)
    return make_attention_metadata(query_lens, seq_lens, table, block_size=block_size, **kwargs)


def np_(x):
    return np.asarray(x).tolist()


# ---------------------------------------------------------------- local-attention virtual batches


# vLLM's docstring example (9 and 10 columns) and the other cases of vLLM's
# tests/v1/attention/test_chunked_local_attention.py; block table row r holds r*P ... r*P + P-1.
# Note: the docstring's "cu_seqlens_q_local = [0, 4, 6, 10, 14, 18, 19, 23, 24]" is the cumsum of the *key*
# lengths (it ends at 24, but the batch has 19 query tokens); vLLM's test pins the query lengths below.
VLLM_EXAMPLES = [
    # query_lens, seq_lens, chunk, block, P, virtual query lens, virtual seq lens, virtual block tables
    ([4, 10, 5], [6, 17, 9], 4, 2, 9, [2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1],
     [[0, 1], [2, 3], [11, 12], [13, 14], [15, 16], [17, 17], [20, 21], [22, 23]]),
    ([4, 10, 5], [6, 17, 9], 4, 2, 10, [2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1],
     [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]),
    ([8], [12], 4, 2, 6, [4, 4], [4, 4], [[2, 3], [4, 5]]),
    ([7], [10], 4, 2, 5, [1, 4, 2], [4, 4, 2], [[0, 1], [2, 3], [4, 4]]),
    ([4], [6], 10, 2, 3, [4], [6], [[0, 1, 2, 2, 2]]),
    ([6, 6], [8, 8], 4, 4, 2, [2, 4, 2, 4], [4, 4, 4, 4], [[0], [1], [2], [3]]),
    ([1], [5], 4, 2, 3, [1], [1], [[2, 2]]),
]  # fmt: skip


@pytest.mark.parametrize(
    "query_lens, seq_lens, chunk, block_size, num_cols, v_query_lens, v_seq_lens, v_tables", VLLM_EXAMPLES
)
def test_virtual_batches_reproduce_vllm_examples(
    query_lens, seq_lens, chunk, block_size, num_cols, v_query_lens, v_seq_lens, v_tables
):
    table = np.arange(len(seq_lens) * num_cols).reshape(len(seq_lens), num_cols)
    real = make_attention_metadata(query_lens, seq_lens, table, block_size=block_size)
    virtual = make_local_attention_virtual_batches(chunk, real, block_size)
    assert np_(virtual.query_start_loc) == np.concatenate([[0], np.cumsum(v_query_lens)]).tolist()
    assert np_(virtual.seq_lens) == v_seq_lens
    assert np_(virtual.block_tables) == v_tables
    assert np_(virtual.slot_mapping) == np_(real.slot_mapping)
    assert int(virtual.num_actual_tokens) == sum(query_lens)
    assert (virtual.max_query_len, virtual.max_seq_len, virtual.causal) == (max(v_query_lens), max(v_seq_lens), True)


def test_virtual_batches_worked_example_query_start_loc():
    real = make_attention_metadata([4, 10, 5], [6, 17, 9], np.arange(27).reshape(3, 9), block_size=2)
    virtual = make_local_attention_virtual_batches(4, real, 2)
    assert np_(virtual.query_start_loc) == [0, 2, 4, 5, 9, 13, 14, 18, 19]


def expected_virtual_requests(query_lens, seq_lens, chunk):
    """(owner, query_len, seq_len, first key position) of each virtual request, by walking the chunks."""
    rows = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        first_chunk = (s - 1) // chunk if q == 0 else (s - q) // chunk
        for k in range(first_chunk, (s - 1) // chunk + 1):
            start, end = k * chunk, min(s, (k + 1) * chunk)
            rows.append((r, end - max(s - q, start), end - start, start))
    return rows


@st.composite
def chunked_batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunk = block_size * draw(st.sampled_from([1, 2, 4, 8]))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    query_lens = [draw(st.integers(0, s)) for s in seq_lens]
    return chunk, block_size, query_lens, seq_lens


@settings(max_examples=50, deadline=None)
@given(chunked_batches())
def test_virtual_batch_invariants(batch):
    chunk, block_size, query_lens, seq_lens = batch
    real = metadata_for(query_lens, seq_lens, block_size)
    virtual = make_local_attention_virtual_batches(chunk, real, block_size)
    v_query_lens = np.diff(np.asarray(virtual.query_start_loc))
    v_seq_lens = np.asarray(virtual.seq_lens)
    expected = expected_virtual_requests(query_lens, seq_lens, chunk)

    assert v_query_lens.sum() == sum(query_lens)
    assert np.all((v_query_lens <= chunk) & (v_seq_lens >= 1) & (v_seq_lens <= chunk))
    assert np.all(v_query_lens <= v_seq_lens)
    # One virtual request per chunk touched by the request's queries; a request without queries yields
    # exactly one empty virtual request over its last chunk (vLLM's n_local = 1 + cdiv(0, c)).
    touched = [1 if q == 0 else (s - 1) // chunk - (s - q) // chunk + 1 for q, s in zip(query_lens, seq_lens)]
    assert len(v_query_lens) == sum(touched) == len(expected)
    owners = np.array([row[0] for row in expected])
    assert np.all((v_query_lens >= 1) == (np.asarray(query_lens)[owners] > 0))
    assert v_query_lens.tolist() == [row[1] for row in expected]
    assert v_seq_lens.tolist() == [row[2] for row in expected]

    real_table, v_table = np.asarray(real.block_tables), np.asarray(virtual.block_tables)
    assert v_table.shape == (len(expected), chunk // block_size)
    for v, (owner, _, seq_len, key_start) in enumerate(expected):
        positions = np.arange(seq_len)
        np.testing.assert_array_equal(
            v_table[v, positions // block_size], real_table[owner, (key_start + positions) // block_size]
        )
    assert np_(virtual.slot_mapping) == np_(real.slot_mapping)
    assert virtual.max_query_len == max(v_query_lens, default=0)


@pytest.mark.parametrize(
    "chunk, block_size, query_lens, seq_lens, null_unreachable",
    [
        (4, 2, [4, 10, 5], [6, 17, 9], False),  # vLLM's worked example
        (8, 4, [1, 1, 13], [9, 16, 30], True),  # decodes on either side of a chunk edge; a long extend
        (4, 4, [7, 1, 12], [7, 12, 12], True),  # chunk == block; prefills starting at a chunk edge
        (6, 2, [11, 0, 3], [23, 5, 3], False),  # queries start mid-chunk; a request without queries
        (8, 2, [1, 17], [33, 20], True),  # many chunks crossed by one request
    ],
)
def test_chunked_reference_equals_causal_reference_on_virtual_batch(
    chunk, block_size, query_lens, seq_lens, null_unreachable
):
    nulls = dict(attention_chunk_size=chunk) if null_unreachable else None
    inputs = random_inputs(query_lens, seq_lens, block_size, null_unreachable_for=nulls)
    virtual = make_local_attention_virtual_batches(chunk, inputs.metadata, block_size)
    chunked = paged_attention(
        inputs.q, inputs.kv_cache, inputs.metadata, params=LayerAttentionParams(attention_chunk_size=chunk)
    )
    plain = paged_attention(inputs.q, inputs.kv_cache, virtual, checked=True)
    assert np.all(np.isfinite(chunked))
    np.testing.assert_allclose(plain, chunked, **TOL)


# ---------------------------------------------------------------- decode / prefill split and reorder


@pytest.mark.parametrize(
    "query_lens, threshold, require_uniform, expected",
    [
        ([1, 1, 1], 1, False, (3, 0, 3, 0)),  # all decodes
        ([5, 3, 7], 1, False, (0, 3, 0, 15)),  # all prefills
        ([1, 1, 4, 1, 2], 1, False, (2, 3, 2, 7)),  # decode-first; everything from the first long one on
        ([2, 1, 3, 1], 2, False, (2, 2, 3, 4)),  # threshold > 1
        ([3, 3], 2, False, (0, 2, 0, 6)),  # first request above the threshold
        ([2, 2, 1, 2], 2, True, (2, 2, 4, 3)),  # uniform: a shorter length also ends the decodes
        ([2, 2, 2], 2, True, (3, 0, 6, 0)),  # uniform and all equal
        ([1, 2, 2], 2, False, (3, 0, 5, 0)),  # not uniform: lengths may differ
        ([], 1, False, (0, 0, 0, 0)),  # empty batch
    ],
)
def test_split_decodes_and_prefills(query_lens, threshold, require_uniform, expected):
    metadata = metadata_for(query_lens, [q + 3 for q in query_lens], block_size=4)
    got = split_decodes_and_prefills(metadata, decode_threshold=threshold, require_uniform=require_uniform)
    assert got == expected


def test_split_require_uniform_zero_padded_batch_is_all_decodes():
    # vLLM (reference section 2.6): with require_uniform, a uniform batch padded with query length 0
    # requests counts as all decodes.
    metadata = metadata_for([2, 2, 0, 0], [5, 6, 3, 1], block_size=4)
    assert split_decodes_and_prefills(metadata, decode_threshold=2, require_uniform=True) == (4, 0, 4, 0)


# Threshold 2. Classes: decode (short, has context), short extend (short, no context), long extend (long,
# has context), prefill (long, no context).
REORDER_QUERY_LENS = [5, 1, 4, 2, 2, 3, 3, 1]
REORDER_SEQ_LENS = [5, 7, 9, 2, 6, 3, 10, 1]
REORDER_EXPECTED = [1, 4, 3, 7, 2, 6, 0, 5]  # decodes 1,4 · short extends 3,7 · long extends 2,6 · prefills 0,5


def expected_token_order(query_lens, request_order, num_tokens):
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    tokens = [t for r in request_order for t in range(starts[r], starts[r + 1])]
    return tokens + list(range(starts[-1], num_tokens))


def test_reorder_decodes_first_classes_tokens_and_attention():
    block_size, pad = 4, 3
    inputs = random_inputs(REORDER_QUERY_LENS, REORDER_SEQ_LENS, block_size, seed=3)
    num_tokens = sum(REORDER_QUERY_LENS) + pad
    metadata = make_attention_metadata(
        REORDER_QUERY_LENS, REORDER_SEQ_LENS, np.asarray(inputs.metadata.block_tables),
        block_size=block_size, num_tokens=num_tokens,
    )  # fmt: skip
    padding = np.random.default_rng(4).standard_normal((pad, *inputs.q.shape[1:]))
    q = jnp.concatenate([inputs.q, jnp.asarray(padding, jnp.float32)])

    reordered, token_order = reorder_decodes_first(metadata, decode_threshold=2)
    order = REORDER_EXPECTED
    assert token_order.tolist() == expected_token_order(REORDER_QUERY_LENS, order, num_tokens)
    assert token_order[-pad:].tolist() == list(range(num_tokens - pad, num_tokens))
    assert np_(reordered.seq_lens) == [REORDER_SEQ_LENS[r] for r in order]
    assert np_(reordered.query_lens) == [REORDER_QUERY_LENS[r] for r in order]
    assert np_(reordered.block_tables) == [np_(metadata.block_tables)[r] for r in order]
    assert np_(reordered.slot_mapping) == np.asarray(metadata.slot_mapping)[token_order].tolist()
    assert int(reordered.num_actual_tokens) == int(metadata.num_actual_tokens)

    original = paged_attention(q, inputs.kv_cache, metadata)
    moved = paged_attention(q[token_order], inputs.kv_cache, reordered, checked=True)
    np.testing.assert_allclose(moved, np.asarray(original)[token_order], **TOL)
    np.testing.assert_array_equal(np.asarray(moved)[-pad:], 0)
    assert split_decodes_and_prefills(reordered, decode_threshold=2) == (4, 4, 6, 15)


def test_reorder_is_prefilling_overrides_context():
    # Request 0 has context but is still prefilling: a short extend, after the decode (request 1).
    metadata = metadata_for([1, 1, 6], [4, 4, 6], block_size=4)
    reordered, _ = reorder_decodes_first(metadata, is_prefilling=[True, False, True])
    assert np_(reordered.seq_lens) == [4, 4, 6]
    assert np_(reordered.block_tables) == [np_(metadata.block_tables)[r] for r in (1, 0, 2)]


# ---------------------------------------------------------------- block-table expansion


def test_expand_block_tables_vllm_example():
    table = jnp.asarray([[0, 1, 2], [7, 3, 5]], jnp.int32)
    expanded = expand_block_tables(table, allocator_block_size=16, kernel_block_size=8)
    assert np_(expanded) == [[0, 1, 2, 3, 4, 5], [14, 15, 6, 7, 10, 11]]
    assert np_(expand_block_tables(table, allocator_block_size=8, kernel_block_size=8)) == np_(table)


def split_cache_blocks(kv_cache, ratio):
    """[B, 2, S, K, H] -> [B*ratio, 2, S/ratio, K, H]: kernel block b*ratio + j = rows j*S/ratio... of block b."""
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    sub = kv_cache.reshape(num_blocks, 2, ratio, block_size // ratio, num_kv_heads, head_dim)
    sub = jnp.swapaxes(sub, 1, 2)  # [B, ratio, 2, S/ratio, K, H]
    return sub.reshape(num_blocks * ratio, 2, block_size // ratio, num_kv_heads, head_dim)


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 20, 3], [40, 20, 17]), ([33], [50])])
def test_expanded_tables_give_same_attention_and_slots(query_lens, seq_lens):
    inputs = random_inputs(query_lens, seq_lens, block_size=16, seed=5)
    expanded = expand_block_tables(inputs.metadata.block_tables, allocator_block_size=16, kernel_block_size=8)
    kernel_metadata = make_attention_metadata(query_lens, seq_lens, expanded, block_size=8)
    assert np_(kernel_metadata.slot_mapping) == np_(inputs.metadata.slot_mapping)

    kernel_cache = split_cache_blocks(inputs.kv_cache.data, 2)
    window = LayerAttentionParams(sliding_window=11)
    expected = paged_attention(inputs.q, inputs.kv_cache, inputs.metadata, params=window)
    got = paged_attention(inputs.q, kernel_cache, kernel_metadata, params=window, checked=True)
    assert np.all(np.isfinite(expected))
    np.testing.assert_allclose(got, expected, **TOL)


# ---------------------------------------------------------------- make_attention_metadata and the pytree


def loop_slot_mapping(query_lens, seq_lens, table, block_size, num_tokens):
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(int(table[r][pos // block_size]) * block_size + pos % block_size)
    return slots + [PAD_SLOT_ID] * (num_tokens - len(slots))


@pytest.mark.parametrize(
    "query_lens, seq_lens, block_size, pad",
    [([3, 1, 0, 6], [3, 9, 4, 13], 4, 0), ([1, 5], [17, 5], 2, 4), ([7], [7], 1, 1), ([], [], 4, 2)],
)
def test_slot_mapping_matches_loop(query_lens, seq_lens, block_size, pad):
    num_cols = max(1, -(-max(seq_lens, default=0) // block_size)) + 1
    table = np.random.default_rng(6).permutation(100)[: len(seq_lens) * num_cols].reshape(len(seq_lens), num_cols)
    num_tokens = sum(query_lens) + pad
    metadata = make_attention_metadata(query_lens, seq_lens, table, block_size=block_size, num_tokens=num_tokens)
    assert np_(metadata.slot_mapping) == loop_slot_mapping(query_lens, seq_lens, table, block_size, num_tokens)
    assert np_(metadata.query_start_loc) == np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    assert int(metadata.num_actual_tokens) == sum(query_lens)
    assert (metadata.max_query_len, metadata.max_seq_len) == (max(query_lens, default=0), max(seq_lens, default=0))
    assert all(getattr(metadata, f).dtype == jnp.int32 for f in ("query_start_loc", "seq_lens", "slot_mapping"))


def test_metadata_is_a_pytree_that_survives_jit():
    metadata = metadata_for([2, 5], [9, 5], block_size=4, max_query_len=8, max_seq_len=16, causal=False)
    assert len(jax.tree_util.tree_leaves(metadata)) == 5
    out = jax.jit(lambda m: m)(metadata)
    assert isinstance(out, AttentionMetadata)
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_actual_tokens"):
        np.testing.assert_array_equal(getattr(out, field), getattr(metadata, field))
    assert (out.max_query_len, out.max_seq_len, out.causal) == (8, 16, False)
    # Static fields are part of the tree structure: the traced function sees Python values.
    seen = jax.jit(lambda m: m.seq_lens * m.max_seq_len if not m.causal else m.seq_lens)(metadata)
    assert np_(seen) == [9 * 16, 5 * 16]
