"""Every rule of vLLM v1's hybrid KV-cache allocator (vLLM 0.33), each with a worked example."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import NULL_BLOCK_ID, PAD_SLOT_ID
from jax_hybrid_attn.allocator import KVCacheManager, allocate_slots, group_rules
from jax_hybrid_attn.allocator.columns import HASHED, MAP_SLOT, STAMP, STAMP_COUNTER
from jax_hybrid_attn.allocator.config import SLIDING_WINDOW
from jax_hybrid_attn.allocator.coordinator import find_longest_cache_hit
from jax_hybrid_attn.allocator.pool import STAMP_RENORMALIZE_AT
from jax_hybrid_attn.testing import device_dependent_control_flow

from .allocator_cases import CONFIGS, Mirror, check_invariants, chunked, full, make_config, window

BASIC = make_config([full(16)], num_blocks=11, max_model_len=256, max_num_batched_tokens=256)
WINDOW_2_4 = make_config(
    [window(2, 4)], num_blocks=16, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16
)
CHUNK_4_8 = make_config(
    [chunked(4, 8)], num_blocks=16, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16
)
HYBRID = CONFIGS["hybrid"]  # full 4, window 7 (x2), chunked 8; block 4


def state_leaves(manager):
    return [np.asarray(x) for x in jax.tree.leaves(manager.state)]


def semantic_leaves(manager):
    """The state without where the prefix map put each block (inserts made together or one by one may land in
    other slots of the same buckets; lookups find the same blocks)."""
    pool = manager.state.pool
    info = np.asarray(pool.info).copy()
    info[:, MAP_SLOT] = 0
    return [info, np.asarray(pool.ring), np.asarray(pool.counters)] + [
        np.asarray(x) for x in jax.tree.leaves(manager.state.requests)
    ]


# ------------------------------------------------------------------------------------ block pool, free order


def test_free_queue_order_of_vllm_033_basic_prefill_example():
    """Pool of 11, block 16: req0 holds [1,2,3,4] (1-3 hashed); req1 hits 1-3 and gets 5 (unhashed).
    Freeing req0 then req1 leaves [5,4,6,7,8,9,10,3,2,1] (vLLM 0.33: unhashed to the head, hashed to the tail)."""
    mirror = Mirror(BASIC)
    manager = mirror.manager
    assert manager.free_block_queue() == list(range(1, 11))  # ascending ids; the null block is not in it
    common = list(range(48))
    mirror.add("req0", common + [100] * 7)
    mirror.schedule([("req0", 55)])
    assert manager.get_block_ids("req0") == [[1, 2, 3, 4]]
    mirror.add("req1", common + [200] * 7)
    assert manager.get_computed_blocks("req1") == ([[1, 2, 3]], 48)
    mirror.schedule([("req1", 55)])
    assert manager.get_block_ids("req1") == [[1, 2, 3, 5]]
    assert manager.free_block_queue() == [6, 7, 8, 9, 10]
    mirror.free("req0")
    assert manager.free_block_queue() == [4, 6, 7, 8, 9, 10]
    mirror.free("req1")
    assert manager.free_block_queue() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert manager.make_prefix_cache_stats().hits == 48


def test_common_prefix_blocks_are_those_every_running_request_holds():
    """vLLM's `get_num_common_prefix_blocks`: req0 and req1 share 3 cached blocks of 16, so both hold them; a
    third request with another prompt ends the common prefix; once it leaves, the 3 are common again; none
    runs: 0. (The mirror also compares every count with the oracle's after each step.)"""
    mirror = Mirror(BASIC)
    manager = mirror.manager
    assert manager.get_num_common_prefix_blocks() == [0]
    common = list(range(48))
    mirror.add("req0", common + [100] * 7)
    mirror.schedule([("req0", 55)])
    assert manager.get_num_common_prefix_blocks() == [4]  # one request holds all of its blocks alone
    mirror.add("req1", common + [200] * 7)
    mirror.schedule([("req1", 55)])
    assert manager.get_num_common_prefix_blocks() == [3]
    mirror.add("req2", [300] * 20)
    mirror.schedule([("req2", 20)])
    assert manager.get_num_common_prefix_blocks() == [0]
    mirror.free("req2")
    assert manager.get_num_common_prefix_blocks() == [3]
    mirror.free("req0")
    mirror.free("req1")
    assert manager.get_num_common_prefix_blocks() == [0]


def test_null_block_is_never_handed_out_nor_freed():
    manager = KVCacheManager(BASIC)
    manager.add_request("a", list(range(160)))
    assert manager.allocate_slots("a", 160) == [list(range(1, 11))]  # the whole pool but block 0
    manager.add_request("b", [7] * 16)
    assert manager.allocate_slots("b", 16) is None
    assert manager.usage == 1.0
    manager.free("a")
    assert NULL_BLOCK_ID not in manager.free_block_queue() and len(manager.free_block_queue()) == 10
    assert manager.usage == 0.0


def test_eviction_takes_the_head_and_a_freed_request_returns_its_tail_first():
    """Hashed blocks of a finished request go to the tail, tail block first: its parents are evicted last."""
    mirror = Mirror(BASIC)
    mirror.add("a", list(range(64)))  # four full blocks, all cached
    mirror.schedule([("a", 64)])
    mirror.free("a")
    assert mirror.manager.free_block_queue() == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    mirror.add("b", [999] * 112)  # seven fresh blocks: the six untouched ones, then 4, the last block of "a"
    mirror.schedule([("b", 112)])
    assert mirror.manager.get_block_ids("b") == [[5, 6, 7, 8, 9, 10, 4]]
    mirror.add("c", list(range(64)))  # "a"'s prompt again: blocks 1-3 are still cached (lazy eviction)
    assert mirror.manager.get_computed_blocks("c") == ([[1, 2, 3]], 48)


def test_freed_block_keeps_its_hash_until_reused():
    mirror = Mirror(BASIC)
    mirror.add("a", list(range(33)))
    mirror.schedule([("a", 33)])
    mirror.free("a")
    pool = mirror.manager.state.pool
    assert bool(pool.block_hashed[1]) and bool(pool.block_hashed[2]) and not bool(pool.block_hashed[3])
    mirror.add("b", list(range(33)))
    mirror.schedule([("b", 33)])  # hits 1, 2; block 3 (unhashed, at the head) is reused for the tail
    assert mirror.manager.get_block_ids("b") == [[1, 2, 3]]


def test_caching_off_returns_every_block_to_the_head_later_groups_in_front():
    mirror = Mirror(CONFIGS["no_cache_in_window"])  # full 4, window 6 (in-window only); no caching
    mirror.add("a", list(range(10)))
    mirror.schedule([("a", 8)])
    mirror.schedule([("a", 2)])
    mirror.schedule(
        [("a", 1)]
    )  # from position 10 the window starts at 5: block 3 (positions 0-3) goes to the head
    assert mirror.manager.get_block_ids("a") == [[1, 2, 5], [0, 4, 6]]
    assert mirror.manager.free_block_queue()[:2] == [3, 7]
    mirror.free("a")  # group 0 prepends [5, 2, 1], then group 1 prepends [6, 4] in front of it
    assert mirror.manager.free_block_queue()[:7] == [6, 4, 5, 2, 1, 3, 7]


# ------------------------------------------------------------------------------------------- skipped tokens


@pytest.mark.parametrize(
    "spec, computed, skipped",
    [
        (window(1, 4), 7, 4),
        (chunked(8, 8), 13, 8),
        (chunked(8, 8), 8, 8),
        (chunked(8, 8), 7, 0),
        (full(4), 99, 0),
    ],
)
def test_skipped_tokens_docstring_examples(spec, computed, skipped):
    constants = group_rules.group_constants(make_config([spec]))
    assert int(group_rules.num_skipped_tokens(constants, jnp.array([computed]))[0, 0]) == skipped


def test_a_block_is_freed_only_when_all_its_tokens_are_skipped():
    """Block 2, window 4: at n=4 one token is skipped and no block is freed; at n=5, block 0 goes."""
    mirror = Mirror(WINDOW_2_4)
    mirror.add("r", [1, 2, 3, 4, 5, 6])
    mirror.schedule([("r", 4)])
    assert mirror.manager.get_block_ids("r") == [[1, 2]]
    mirror.schedule([("r", 1)])  # n = 4
    assert mirror.manager.get_block_ids("r") == [[1, 2, 3]]
    mirror.schedule([("r", 1)])  # n = 5: tokens 0, 1 skipped
    assert mirror.manager.get_block_ids("r") == [[NULL_BLOCK_ID, 2, 3]]
    assert mirror.manager.free_block_queue()[-1] == 1  # cached, so to the tail


def test_window_blocks_are_freed_highest_index_first():
    mirror = Mirror(WINDOW_2_4)
    mirror.add("r", list(range(11)))
    mirror.schedule([("r", 10)])
    assert mirror.manager.get_block_ids("r") == [[1, 2, 3, 4, 5]]
    mirror.schedule([("r", 1)])  # n = 10: tokens 0..6 skipped, blocks 0..2 freed as 3, 2, 1
    assert mirror.manager.get_block_ids("r") == [[0, 0, 0, 4, 5, 6]]
    assert mirror.manager.free_block_queue()[-3:] == [3, 2, 1]


def test_chunk_blocks_are_freed_at_the_chunk_boundary():
    mirror = Mirror(CHUNK_4_8)
    mirror.add("r", list(range(8)))  # hits need num_tokens - 1 >= 8 to skip a chunk: none here
    mirror.schedule([("r", 7)])
    assert mirror.manager.get_block_ids("r") == [[1, 2]]
    mirror.schedule([("r", 1)])  # n = 7: the chunk is not complete
    assert mirror.manager.get_block_ids("r") == [[1, 2]]
    mirror.append("r", [8])
    mirror.schedule([("r", 1)])  # n = 8: chunk 0 is behind
    assert mirror.manager.get_block_ids("r") == [[0, 0, 3]]
    assert mirror.manager.free_block_queue()[-2:] == [2, 1]


def test_chunked_local_request_skips_completed_chunks_of_its_prompt():
    """vLLM's rule: blocks before the current chunk count as hits without lookup, even with an empty cache; a
    chunked-local-only model never reads them."""
    mirror = Mirror(CHUNK_4_8)
    mirror.add("r", list(range(12)))
    out = mirror.schedule([("r", 12)])
    assert (int(out.num_new_computed_tokens[0]), int(out.num_scheduled_tokens[0])) == (8, 4)
    assert mirror.manager.get_block_ids("r") == [[0, 0, 1]]


# --------------------------------------------------------------------------------------------- hit search


def hits(*flags):
    return jnp.asarray(flags, bool)


def test_full_attention_hit_is_left_to_right_to_the_first_miss():
    find = group_rules.find_full
    assert int(find(hits(1, 1, 0, 1, 1), 20, block_size=4, alignment=4)) == 8
    assert int(find(hits(1, 1, 1, 1, 1), 15, block_size=4, alignment=4)) == 12  # max_length caps
    assert int(find(hits(1, 1, 1, 0, 0), 20, block_size=4, alignment=8)) == 8  # aligned down


def test_sliding_window_hit_is_the_rightmost_contiguous_run():
    """Window 9, block 4: a run of cdiv(8, 4) = 2 blocks suffices, searched right to left."""
    find = group_rules.find_sliding_window
    options = dict(block_size=4, alignment=4, window=9)
    assert int(find(hits(1, 0, 1, 1, 0, 1), 24, **options)) == 16  # run at blocks 2-3; block 5 alone is short
    assert int(find(hits(1, 1, 0, 0, 0, 1), 24, **options)) == 8  # no run: the prefix run at block 0
    assert int(find(hits(1, 0, 0, 0, 0, 1), 24, **options)) == 4  # a prefix shorter than the window is valid
    assert int(find(hits(0, 1, 1, 1, 1, 1), 24, **options)) == 24
    assert int(find(hits(0, 1, 0, 1, 0, 1), 24, **options)) == 0
    # alignment 8: a run may only end on an 8-token boundary, so block 4 (ending at 20) cannot end it
    assert int(find(hits(0, 0, 1, 1, 1, 0), 24, block_size=4, alignment=8, window=9)) == 16
    constants = group_rules.group_constants(make_config([window(4, 9)]))
    assert int(group_rules.hit_start_block(constants, jnp.asarray(16))[0, 0]) == 2  # [null, null, blk2, blk3]


@pytest.mark.parametrize(
    "max_length, flags, length, first_real",
    [(15, (0, 0, 1, 0), 12, 2), (15, (0, 0, 0, 0), 8, 2), (16, (0, 0, 0, 0), 16, 4)],
)
def test_chunked_local_hit_docstring_examples(max_length, flags, length, first_real):
    """Chunk 8, block 4: max_length 15 -> [null, null, blk2] when block 2 hits, else [null, null]; 16 -> 4 nulls."""
    assert int(group_rules.find_chunked_local(hits(*flags), max_length, block_size=4, chunk=8)) == length
    constants = group_rules.group_constants(make_config([chunked(4, 8)]))
    assert int(group_rules.hit_start_block(constants, jnp.asarray(length))[0, 0]) == first_real


def test_chunked_local_completed_chunks_count_without_lookup():
    mirror = Mirror(CHUNK_4_8)
    mirror.add("a", list(range(20)))
    mirror.schedule([("a", 16)])  # 16 tokens of completed chunks are skipped: only block 4 is computed
    assert mirror.manager.get_block_ids("a") == [[0, 0, 0, 0, 1]]
    mirror.free("a")  # block 1 is cached: it goes to the tail
    mirror.add("b", list(range(17)))  # max hit 16 = two completed chunks: no lookup, no block
    assert mirror.manager.get_computed_blocks("b") == ([[0, 0, 0, 0]], 16)
    mirror.schedule([("b", 16)])  # a budget: 1 token is left after the hit
    assert mirror.manager.get_block_ids("b") == [[0, 0, 0, 0, 2]]


def test_hybrid_fixed_point_shrinks_until_every_group_agrees():
    """Full attention hits 8 blocks, a window group (need 2) misses block 5, a chunked group (chunk 8) misses
    block 6: 28 -> 24 (chunk) -> 20 (window, second pass) -> stable. Full attention is truncated to 5 blocks."""
    config = make_config([full(4), window(4, 9), chunked(4, 8)])
    mask = jnp.asarray([[1] * 8, [1, 1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 0, 1]], bool)
    mask = jnp.pad(mask, ((0, 0), (0, config.max_blocks_per_row - 8)))
    assert int(find_longest_cache_hit(config, mask, 30)) == 20


def test_hybrid_hit_on_the_allocator():
    mirror = Mirror(HYBRID)
    prompt = list(range(30))
    mirror.add("a", prompt)
    mirror.schedule([("a", 30)])
    mirror.free("a")  # blocks 0-6 of every group are cached
    mirror.add("b", prompt)
    blocks, length = mirror.manager.get_computed_blocks("b")
    assert length == 28  # 29 tokens at most; 7 whole blocks
    assert len(blocks[0]) == 7 and 0 not in blocks[0]  # full attention: every block
    for window_blocks in blocks[1:3]:  # window 7 needs cdiv(6, 4) = 2 blocks
        assert window_blocks[:5] == [0] * 5 and 0 not in window_blocks[5:]
    assert blocks[3][:6] == [0] * 6 and blocks[3][6] != 0  # chunk 8: only the current chunk's block
    out = mirror.schedule([("b", 30)])
    assert (int(out.num_new_computed_tokens[0]), int(out.num_scheduled_tokens[0])) == (28, 2)


def test_hit_length_is_capped_at_num_tokens_minus_one():
    mirror = Mirror(BASIC)
    mirror.add("a", list(range(32)))
    mirror.schedule([("a", 32)])
    mirror.add("b", list(range(32)))
    assert mirror.manager.get_computed_blocks("b") == ([[1]], 16)  # the last token is always computed
    out = mirror.schedule([("b", 32)])
    assert (int(out.num_new_computed_tokens[0]), int(out.num_scheduled_tokens[0])) == (16, 16)


def test_same_prompt_twice_in_one_batch_hits_the_first_rows_blocks():
    mirror = Mirror(BASIC)
    mirror.add("a", list(range(40)))
    mirror.add("b", list(range(40)))
    out = mirror.schedule([("a", 40), ("b", 40)])
    assert int(out.num_new_computed_tokens[1]) == 32
    assert mirror.manager.get_block_ids("b")[0][:2] == mirror.manager.get_block_ids("a")[0][:2]


# ----------------------------------------------------------------------------------- admission, failure, reset


def test_sliding_window_admission_cap():
    config = make_config([window(16, 1024)], max_model_len=32768, max_num_batched_tokens=2048, num_blocks=300)
    assert config.admission_caps == (-(-(1024 - 1 + 2048) // 16) + 1,) == (193,)
    assert make_config(
        [chunked(16, 8192)], max_model_len=32768, max_num_batched_tokens=2048
    ).admission_caps == (-(-(8192 + 2048) // 16),)


def test_full_sequence_must_fit_gate_uses_the_cap():
    """A 30-token window request fits in its cap of cdiv(3 + 16, 2) + 1 = 11 blocks (15 free), not 15 blocks."""
    mirror = Mirror(WINDOW_2_4)
    mirror.add("long", list(range(30)))
    assert bool(mirror.schedule([("long", 16)], must_fit=[True]).success[0])
    mirror = Mirror(BASIC)  # full attention: all 13 blocks of 200 tokens count, 10 are free
    mirror.add("long", list(range(200)))
    assert not bool(mirror.schedule([("long", 128)], must_fit=[True]).success[0])
    assert bool(mirror.schedule([("long", 128)]).success[0])  # without the gate, 8 blocks suffice now


def test_failed_allocation_leaves_the_state_unchanged():
    mirror = Mirror(WINDOW_2_4)
    manager = mirror.manager
    mirror.add("a", list(range(32)))
    mirror.schedule([("a", 16)])  # 8 blocks held, 7 free
    mirror.add("b", list(range(100, 116)))
    mirror.schedule([("b", 14)])  # 7 blocks: the pool is full
    before = state_leaves(manager)
    # "a" would free its out-of-window blocks 0-5 (vLLM frees them even when the allocation fails) but needs 8
    out = mirror.schedule([("a", 16)])
    assert not bool(out.success[0])
    for old, new in zip(before, state_leaves(manager)):
        np.testing.assert_array_equal(old, new)


def test_a_row_jumping_past_one_steps_blocks_fails_and_changes_nothing():
    """`max_row_step_blocks` bounds what one row frees, takes or caches in a step; a row whose computed tokens
    jump further (no scheduler does that) fails instead of overflowing, and the state is unchanged."""
    config = make_config([full(4)], num_blocks=40, max_model_len=64, max_num_batched_tokens=8)
    assert config.max_row_step_blocks == 3
    manager = KVCacheManager(config)
    manager.add_request("a", list(range(48)))
    slot = manager._slot("a")
    manager.state, out = allocate_slots(
        config, manager.state, jnp.array([slot]), jnp.array([0]), jnp.array([4])
    )
    assert bool(out.success[0])
    before = state_leaves(manager)
    manager.state, out = allocate_slots(
        config, manager.state, jnp.array([slot]), jnp.array([40]), jnp.array([1])
    )
    assert not bool(out.success[0])  # 10 more blocks in one step
    for old, new in zip(before, state_leaves(manager), strict=True):
        np.testing.assert_array_equal(old, new)
    manager.state, out = allocate_slots(
        config, manager.state, jnp.array([slot]), jnp.array([4]), jnp.array([8])
    )
    assert bool(out.success[0])  # a real step still works


def test_a_later_row_succeeds_after_an_earlier_row_fails():
    mirror = Mirror(BASIC)
    mirror.add("big", list(range(200)))
    mirror.add("small", list(range(1000, 1020)))
    out = mirror.schedule([("big", 200), ("small", 20)])  # 13 blocks: no; then 2 blocks: yes
    assert [bool(x) for x in out.success[:2]] == [False, True]


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    mirror = Mirror(BASIC)
    mirror.add("a", list(range(40)))
    mirror.schedule([("a", 40)])
    assert not mirror.manager.reset_prefix_cache()
    mirror.free("a")
    mirror.reset()
    assert not bool(jnp.any(mirror.manager.state.pool.block_hashed))
    mirror.add("b", list(range(40)))
    assert mirror.manager.get_computed_blocks("b") == ([[]], 0)


# ---------------------------------------------------------------------------------------------- the step


def test_outputs_are_block_tables_and_slot_mappings_for_the_kernels():
    config = HYBRID
    manager = KVCacheManager(config)
    manager.add_request("a", list(range(10)))
    manager.add_request("b", list(range(50, 55)))
    out = manager.schedule([("a", 6), ("b", 5)])
    np.testing.assert_array_equal(out.query_start_loc[:3], [0, 6, 11])
    for g, block_size in enumerate(config.block_sizes):
        table = np.asarray(out.block_tables[g, :, : config.blocks_per_row[g]])
        mapping = np.asarray(out.slot_mappings[g])
        assert out.block_tables.shape == (config.num_groups, config.max_num_seqs, config.max_blocks_per_row)
        positions = list(range(6)) + list(range(5))
        rows = [0] * 6 + [1] * 5
        want = [table[r, p // block_size] * block_size + p % block_size for r, p in zip(rows, positions)]
        np.testing.assert_array_equal(mapping[:11], want)
        assert np.all(mapping[11:] == PAD_SLOT_ID)
        np.testing.assert_array_equal(
            table[0, : len(manager.get_block_ids("a")[g])], manager.get_block_ids("a")[g]
        )
    assert np.all(np.asarray(out.block_tables)[:, 2:] == NULL_BLOCK_ID)  # padding rows
    np.testing.assert_array_equal(out.token_ids[:11], list(range(6)) + list(range(50, 55)))
    np.testing.assert_array_equal(out.positions[:11], positions)


def test_one_batch_equals_one_row_at_a_time():
    """The vectorised path and the sequential path leave identical states (some rows fail: the pool is small)."""
    config = HYBRID
    one, many = KVCacheManager(config), KVCacheManager(config)
    prompts = [list(range(r, r + 5 + 2 * r)) for r in range(4)]
    for manager in (one, many):
        for r, prompt in enumerate(prompts):
            manager.add_request(r, prompt)
    for step in range(10):
        batch = [(r, len(prompts[r]) if step == 0 else 1) for r in range(4)]
        if step:
            for manager in (one, many):
                for r in range(4):
                    if manager.num_computed_tokens(r) == manager.num_tokens(r):
                        manager.append_token_ids(r, [step])
        many.schedule(batch)
        for row in batch:
            one.schedule([row])
        for a, b in zip(semantic_leaves(one), semantic_leaves(many)):
            np.testing.assert_array_equal(a, b)
        check_invariants(one)
        check_invariants(many)


def test_in_window_only_clips_chunks_so_no_block_is_freed_after_one_step():
    config = CONFIGS["in_window_cached"]  # window 5 then full, block 2
    mirror = Mirror(config)
    mirror.add("r", list(range(14)))
    out = mirror.schedule([("r", 12)])  # positions 0..4: the next step, from 5, still reads 1..4
    assert int(out.num_scheduled_tokens[0]) == 5 - 2 + 2
    assert mirror.manager.get_block_ids("r")[0] == [1, 2, 3]
    out = mirror.schedule([("r", 12)])  # from 5 (odd): 5 - 2 + 2 - 1 tokens, 5..8
    assert int(out.num_scheduled_tokens[0]) == 4
    held = mirror.manager.get_block_ids("r")[0]
    assert len(held) == 5 and NULL_BLOCK_ID not in held  # position 5 still reads 1..5
    out = mirror.schedule([("r", 12)])  # from 9: 9..12; position 9 reads 5.. so blocks 0 and 1 leave
    assert int(out.num_scheduled_tokens[0]) == 4
    assert mirror.manager.get_block_ids("r")[0][:3] == [NULL_BLOCK_ID, NULL_BLOCK_ID, held[2]]
    assert config.admission_caps[0] == 2 * (-(-4 // 2) + 1) == 6
    assert (
        CONFIGS["no_cache_in_window"].admission_caps[1] == -(-(6 - 1 + 6 - 2 + 4 + 3) // 4) + 1
    )  # lookahead 3


@pytest.mark.parametrize("name", ["in_window_cached", "no_cache_in_window"])
def test_in_window_only_steps_give_exact_attention_from_the_cache(name):
    """Prefill in budget-sized chunks, then decode, writing K/V by the allocator's slot mapping into a NaN cache:
    attention over the allocator's block tables equals dense attention over the whole sequence, at every step;
    no block taken by a step is out of the window at the next one."""
    from jax_hybrid_attn import LayerAttentionParams, reference
    from jax_hybrid_attn.kv_cache import write_kv
    from jax_hybrid_attn.metadata import AttentionMetadata
    from jax_hybrid_attn.testing import TOLERANCES

    from .oracle import attention_float64

    config = CONFIGS[name]
    group = config.kinds.index(SLIDING_WINDOW)
    size, window = config.block_sizes[group], config.sliding_windows[group]
    rng = np.random.default_rng(7)
    length, budget, num_heads, head_dim = 27, 11, 2, 4
    q, k, v = (rng.standard_normal((length, num_heads, head_dim), np.float32) for _ in range(3))
    mirror = Mirror(config)
    mirror.add("r", rng.integers(0, 50, 23).tolist())
    cache = jnp.full((config.num_blocks, 2, size, num_heads, head_dim), jnp.nan, jnp.float32)
    computed, taken_last_step, held_before = 0, set(), set()
    while computed < length:
        if computed >= mirror.manager.num_tokens("r"):
            mirror.append("r", [int(rng.integers(0, 50))])
        out = mirror.schedule([("r", min(budget, mirror.manager.num_tokens("r") - computed))])
        n, t = int(out.num_computed_tokens[0]), int(out.num_scheduled_tokens[0])
        assert n == computed and 1 <= t <= max(1, window - 2 + size - n % size)
        held = set(mirror.manager.get_block_ids("r")[group])
        assert taken_last_step <= held, "a block taken by the previous step left the window"
        taken_last_step, held_before = held - held_before, held
        slots = np.asarray(out.slot_mappings[group][:t])
        assert np.all(slots != PAD_SLOT_ID)
        cache = write_kv(cache, jnp.asarray(k[n : n + t]), jnp.asarray(v[n : n + t]), jnp.asarray(slots))
        width = config.blocks_per_row[group]
        metadata = AttentionMetadata(
            query_start_loc=jnp.array([0, t], jnp.int32),
            seq_lens=jnp.array([n + t], jnp.int32),
            block_tables=jnp.asarray(mirror.manager.state.requests.tables[group, :1, :width]),
            slot_mapping=jnp.asarray(slots),
            num_actual_tokens=jnp.array(t, jnp.int32),
            max_query_len=t,
            max_seq_len=config.max_model_len,
        )
        params = LayerAttentionParams(sliding_window=window)
        got = reference.paged_attention(jnp.asarray(q[n : n + t]), cache, metadata, params=params)
        want = attention_float64(q[n : n + t], [k[: n + t]], [v[: n + t]], [t], sliding_window=window)
        np.testing.assert_allclose(got, want, **TOLERANCES[jnp.dtype(jnp.float32)])
        computed = n + t


def test_verify_hits_rejects_a_block_whose_tokens_differ():
    manager = KVCacheManager(CONFIGS["mixed_block_sizes"])  # full 8, window 3 (block 4), verify_hits
    manager.add_request("a", list(range(33)))
    manager.allocate_slots("a", 32)
    manager.add_request("b", list(range(33)))
    blocks, length = manager.get_computed_blocks("b")
    assert length == 32
    pool = manager.state.pool  # simulate a hash collision: the last full block's stored tokens differ
    pool = dataclasses.replace(pool, block_tokens=pool.block_tokens.at[blocks[0][-1], 0].set(-5))
    manager.state = dataclasses.replace(manager.state, pool=pool)
    assert manager.get_computed_blocks("b")[1] == 24


def test_jitted_step_runs_without_the_python_wrapper():
    config = WINDOW_2_4
    from jax_hybrid_attn.allocator import add_requests, init_state

    state = init_state(config)
    tokens = jnp.zeros((2, config.max_model_len), jnp.int32).at[:, :6].set(jnp.arange(6))
    state = add_requests(config, state, jnp.array([0, 1]), tokens, jnp.array([6, 6]))
    state, out = allocate_slots(config, state, jnp.array([0, 1]), jnp.array([0, 0]), jnp.array([6, 6]))
    assert out.success.tolist() == [True, True]
    assert int(out.num_new_computed_tokens[1]) == 4  # row 1 hits row 0's blocks, cached in the same call
    assert SLIDING_WINDOW in config.kinds


def test_reused_output_buffers_give_the_same_results_in_the_same_memory():
    config = HYBRID
    plain, reusing = KVCacheManager(config), KVCacheManager(config, reuse_output_buffers=True)
    prompts = [list(range(r, r + 6 + 3 * r)) for r in range(3)]
    previous = None
    for manager in (plain, reusing):
        for r, prompt in enumerate(prompts):
            manager.add_request(r, prompt)
    for step in range(6):
        batch = [(r, len(prompts[r]) if step == 0 else 1) for r in range(3)]
        if step:
            for manager in (plain, reusing):
                for r in range(3):
                    manager.append_token_ids(r, [100 + step])
        want, got = plain.schedule(batch), reusing.schedule(batch)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(a, b)
        pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(got)]
        if previous is not None:
            assert all(x.is_deleted() for x in jax.tree.leaves(previous[0]))
            assert pointers == previous[1]
        previous = got, pointers
    for a, b in zip(state_leaves(plain), state_leaves(reusing)):
        np.testing.assert_array_equal(a, b)

    state, rows = reusing.state, jnp.arange(config.max_num_seqs, dtype=jnp.int32)
    ones = jnp.ones(config.max_num_seqs, jnp.int32)
    with pytest.raises(ValueError, match="previous_output.block_tables"):
        allocate_slots(config, state, rows, ones, ones, previous_output=got, return_block_tables=False)


def test_bad_arguments_raise_value_errors_naming_them():
    manager = KVCacheManager(BASIC)
    with pytest.raises(ValueError, match="not a known request"):
        manager.allocate_slots("nobody", 1)
    manager.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already added"):
        manager.add_request("a", [1])
    with pytest.raises(ValueError, match="num_new_tokens=0"):
        manager.allocate_slots("a", 0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        manager.allocate_slots("a", 257)
    with pytest.raises(ValueError, match="max_model_len"):
        manager.add_request("b", [0] * 257)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        manager.allocate_slots("a", 1, num_lookahead_tokens=1)  # max_num_lookahead_tokens is 0
    with pytest.raises(ValueError, match="distinct"):
        manager.schedule([("a", 1), ("a", 1)])
    with pytest.raises(ValueError, match="config"):
        KVCacheManager("not a config")


def test_insertion_stamps_are_reranked_before_they_overflow():
    """A manager whose stamps near int32 overflow re-ranks them in its next step and then behaves exactly like one
    that started from 0: same blocks, same free order, same hits, same stamp order."""
    plain, aged = Mirror(HYBRID), Mirror(HYBRID)
    for mirror in (plain, aged):
        mirror.add("a", list(range(16)))
        mirror.add("b", list(range(8)) + [99] * 8)
        mirror.schedule([("a", 16), ("b", 16)])
    pool = aged.manager.state.pool
    hashed = pool.info[:, HASHED] != 0
    offset = STAMP_RENORMALIZE_AT - int(pool.stamp_counter)  # as if 2**30 blocks had been cached before
    info = pool.info.at[:, STAMP].add(jnp.where(hashed, offset, 0))
    counters = pool.counters.at[STAMP_COUNTER].add(offset)
    aged.manager.state = dataclasses.replace(
        aged.manager.state, pool=dataclasses.replace(pool, info=info, counters=counters)
    )
    for mirror in (plain, aged):
        mirror.append("a", [7])
        mirror.append("b", [8])
        mirror.schedule([("a", 1), ("b", 1)])
        mirror.add("c", list(range(16)))  # hits a's blocks, the first inserted of equal hashes
        mirror.schedule([("c", 16)])
    assert int(aged.manager.state.pool.stamp_counter) < STAMP_RENORMALIZE_AT
    for request in ("a", "b", "c"):
        assert aged.manager.get_block_ids(request) == plain.manager.get_block_ids(request)
    assert aged.manager.free_block_queue() == plain.manager.free_block_queue()

    def stamp_order(mirror):
        info = np.asarray(mirror.manager.state.pool.info)
        hashed_ids = np.flatnonzero(info[:, HASHED])
        return hashed_ids[np.argsort(info[hashed_ids, STAMP], kind="stable")].tolist()

    assert stamp_order(aged) == stamp_order(plain)


def test_colliding_inserts_of_the_first_chunk_are_placed_by_the_loop():
    """One prefix-map bucket: two decodes that fill a block in the same step collide in the vectorised path;
    the loop places the loser although no row is left, and both blocks can be hit."""
    config = make_config([full(4)], num_blocks=3, max_num_seqs=2, max_model_len=16, max_num_batched_tokens=8)
    assert config.num_buckets == 1
    manager = KVCacheManager(config)
    for name, first in (("a", 0), ("b", 100)):
        manager.add_request(name, list(range(first, first + 3)))
    manager.schedule([("a", 3), ("b", 3)])  # one partial block each
    for name, token in (("a", 3), ("b", 103)):
        manager.append_token_ids(name, [token])
    out = manager.schedule([("a", 1), ("b", 1)])  # both blocks become full and are cached together
    assert out.success.tolist() == [True, True]
    pool = manager.state.pool
    blocks = [manager.get_block_ids(name)[0][0] for name in ("a", "b")]
    assert np.asarray(pool.prefix_map)[0, :2].tolist() == blocks  # the earlier row's block won the first slot
    assert int(np.asarray(pool.prefix_map)[0, -1]) == 0b11
    assert all(int(pool.info[b, MAP_SLOT]) >= 0 for b in blocks)


# ------------------------------------------------------------------------------------------ the deferring step


def _step(manager, rows, *, defer_rest, first_chunk_multi_block=False, pad_to=0):
    """rows: [(request_id, computed, new)], then padding rows (negative slots) up to `pad_to` rows, so that
    steps of fewer rows share one compiled step; runs `allocate_slots` on the manager's state. Returns the
    StepOutput."""
    padding = max(0, pad_to - len(rows))
    slots = jnp.array([manager.slot(rid) for rid, _, _ in rows] + [-1] * padding, jnp.int32)
    computed = jnp.array([c for _, c, _ in rows] + [0] * padding, jnp.int32)
    new = jnp.array([n for _, _, n in rows] + [0] * padding, jnp.int32)
    manager.state, out = allocate_slots(manager.config, manager.state, slots, computed, new, defer_rest=defer_rest,
                                        first_chunk_multi_block=first_chunk_multi_block)  # fmt: skip
    check_invariants(manager)
    return out


def _assert_same_steps(outs, managers):
    """The two managers' step outputs and states are equal (where the prefix map put each block aside: inserts
    made together or one by one may land in other slots of a bucket)."""
    for field in dataclasses.fields(outs[False]):
        np.testing.assert_array_equal(getattr(outs[False], field.name), getattr(outs[True], field.name))
    for a, b in zip(semantic_leaves(managers[False]), semantic_leaves(managers[True]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_defer_rest_decode_steps_equal_full_steps():
    """Decodes that cross block edges, leave windows (freeing cached blocks) and cache full blocks: the deferring
    step serves every row, with the same outputs and state as the full step."""
    config = make_config([full(4), window(4, 7), window(4, 7)], num_blocks=40)
    managers = {defer: KVCacheManager(config) for defer in (False, True)}
    prompts = [list(range(10 * r, 10 * r + 5 + 3 * r)) for r in range(3)]
    for manager in managers.values():
        for r, prompt in enumerate(prompts):
            manager.add_request(r, prompt)
        _step(manager, [(r, 0, len(p)) for r, p in enumerate(prompts)], defer_rest=False)
    lengths = [len(p) for p in prompts]
    for step in range(12):
        outs = {}
        for defer, manager in managers.items():
            for r in range(3):
                manager.append_token_ids(r, [500 + 7 * step + r])
            outs[defer] = _step(manager, [(r, lengths[r], 1) for r in range(3)], defer_rest=defer)
        assert not outs[True].deferred.any() and outs[True].success.all(), f"step {step}"
        for field in dataclasses.fields(outs[False]):
            np.testing.assert_array_equal(getattr(outs[False], field.name), getattr(outs[True], field.name))
        lengths = [n + 1 for n in lengths]
    for a, b in zip(state_leaves(managers[False]), state_leaves(managers[True]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_defer_rest_prefill_steps_with_a_multi_block_first_chunk_equal_full_steps():
    """Prompts admitted one per step and prefilled in chunks of several blocks per group, beside decodes, in a
    sliding-window and chunked model: with `first_chunk_multi_block` the deferring step serves every row (no prompt
    shares a prefix), with the outputs and state of the full step after every step."""
    managers = {defer: KVCacheManager(HYBRID) for defer in (False, True)}
    rng = np.random.default_rng(3)
    tokens = [rng.integers(1000 * r, 1000 * r + 999, n).tolist() for r, n in enumerate((15, 9, 13))]
    computed = [0] * len(tokens)
    for step in range(8):
        rows, left = [], HYBRID.max_num_batched_tokens
        for r in range(min(step + 1, len(tokens))):
            if step == r:
                for manager in managers.values():
                    manager.add_request(r, tokens[r])
            elif computed[r] == len(tokens[r]):  # a decode: the token sampled last becomes known
                tokens[r].append(7 * step + r)
                for manager in managers.values():
                    manager.append_token_ids(r, tokens[r][-1:])
            new = min(len(tokens[r]) - computed[r], left, 7)  # chunks of up to 7 tokens: two or three blocks
            rows.append((r, computed[r], new))
            left -= new
        outs = {defer: _step(manager, rows, defer_rest=defer, first_chunk_multi_block=defer,
                             pad_to=len(tokens))
                for defer, manager in managers.items()}  # fmt: skip
        served = slice(0, len(rows))
        assert not outs[True].deferred[served].any() and outs[True].success[served].all(), f"step {step}"
        _assert_same_steps(outs, managers)
        for r, c, n in rows:
            computed[r] = c + n
    assert all(c == len(t) for c, t in zip(computed, tokens, strict=True)), "every prompt prefilled and decoding"


def test_a_deferring_prefill_step_defers_a_new_request_that_may_hit_and_the_rows_after_it():
    manager = KVCacheManager(HYBRID)
    shared = list(range(8))
    manager.add_request("first", shared + [99])
    _step(manager, [("first", 0, 9)], defer_rest=False)  # its full blocks are cached
    manager.add_request("miss", list(range(200, 206)))
    manager.add_request("hit", shared + [77, 78])
    manager.add_request("after", list(range(300, 305)))
    before = {name: manager.get_block_ids(name) for name in ("hit", "after")}
    rows = [("miss", 0, 6), ("hit", 0, 10), ("after", 0, 5)]
    out = _step(manager, rows, defer_rest=True, first_chunk_multi_block=True)
    assert out.success.tolist() == [True, False, False] and out.deferred.tolist() == [False, True, True]
    assert out.num_scheduled_tokens.tolist()[1:] == [0, 0]
    assert {name: manager.get_block_ids(name) for name in ("hit", "after")} == before
    out = _step(manager, rows[1:], defer_rest=False)  # a full step serves them, with the hit
    assert out.success.tolist() == [True, True] and int(out.num_new_computed_tokens[0]) > 0


def test_defer_rest_defers_a_decode_that_completes_a_chunk_and_the_rows_after_it():
    """Reaching a new chunk frees the finished chunk's blocks, several at once: the vectorised path stops there,
    and the rows after it (whose room may depend on it) wait too."""
    manager = KVCacheManager(HYBRID)  # chunk 8, block 4
    prompts = [list(range(10 * r, 10 * r + n)) for r, n in enumerate((5, 8, 11))]
    for r, prompt in enumerate(prompts):
        manager.add_request(r, prompt)
    _step(manager, [(r, 0, len(p)) for r, p in enumerate(prompts)], defer_rest=False)
    for r in range(3):
        manager.append_token_ids(r, [500 + r])
    before = [manager.get_block_ids(r) for r in range(3)]
    out = _step(manager, [(r, len(p), 1) for r, p in enumerate(prompts)], defer_rest=True)
    assert out.success.tolist() == [True, False, False] and out.deferred.tolist() == [False, True, True]
    assert [manager.get_block_ids(r) for r in (1, 2)] == before[1:]
    out = _step(manager, [(r, len(p), 1) for r, p in enumerate(prompts) if r], defer_rest=False)
    assert out.success.tolist() == [True, True]


def test_defer_rest_defers_a_new_request_and_changes_nothing_for_it():
    manager = KVCacheManager(HYBRID)
    manager.add_request("old", list(range(7)))
    _step(manager, [("old", 0, 7)], defer_rest=False)
    manager.append_token_ids("old", [70])
    manager.add_request("new", list(range(100, 109)))
    before = manager.get_block_ids("new")
    out = _step(manager, [("old", 7, 1), ("new", 0, 9)], defer_rest=True)
    assert out.success.tolist() == [True, False] and out.deferred.tolist() == [False, True]
    assert int(out.num_scheduled_tokens[1]) == 0 and manager.get_block_ids("new") == before
    out = _step(manager, [("new", 0, 9)], defer_rest=False)  # a full step serves it
    assert out.success.tolist() == [True] and not out.deferred.any()


@pytest.mark.parametrize("first_chunk_multi_block", [False, True])
def test_defer_rest_defers_every_row_with_work_when_the_pool_is_due_for_maintenance(first_chunk_multi_block):
    manager = KVCacheManager(HYBRID)
    for r in range(2):
        manager.add_request(r, list(range(10 * r, 10 * r + 6)))
    _step(manager, [(0, 0, 6), (1, 0, 6)], defer_rest=False)
    pool = manager.state.pool
    counters = pool.counters.at[STAMP_COUNTER].set(STAMP_RENORMALIZE_AT)  # re-ranking is due
    manager.state = dataclasses.replace(manager.state, pool=dataclasses.replace(pool, counters=counters))
    out = _step(manager, [(0, 6, 3), (1, 6, 3)], defer_rest=True, first_chunk_multi_block=first_chunk_multi_block)
    assert out.deferred.tolist() == [True, True] and not out.success.any()
    out = _step(manager, [(0, 6, 3), (1, 6, 3)], defer_rest=False)
    assert out.success.tolist() == [True, True] and int(manager.state.pool.stamp_counter) < STAMP_RENORMALIZE_AT


def test_colliding_inserts_of_a_deferring_step_are_placed_within_its_rounds():
    config = make_config([full(4)], num_blocks=3, max_num_seqs=2, max_model_len=16, max_num_batched_tokens=8)
    manager = KVCacheManager(config)
    for name, first in (("a", 0), ("b", 100)):
        manager.add_request(name, list(range(first, first + 3)))
    _step(manager, [("a", 0, 3), ("b", 0, 3)], defer_rest=False)
    for name, token in (("a", 3), ("b", 103)):
        manager.append_token_ids(name, [token])
    out = _step(manager, [("a", 3, 1), ("b", 3, 1)], defer_rest=True)  # both blocks cached, colliding
    assert out.success.tolist() == [True, True]
    blocks = [manager.get_block_ids(name)[0][0] for name in ("a", "b")]
    assert np.asarray(manager.state.pool.prefix_map)[0, :2].tolist() == blocks


@pytest.mark.parametrize("defer_rest, first_chunk_multi_block", [(False, False), (True, False), (True, True)])
def test_a_deferring_step_has_no_loop_or_branch_on_device_values(defer_rest, first_chunk_multi_block):
    """On a GPU, XLA reads such a loop's or branch's predicate back to the host before it goes on."""
    from jax_hybrid_attn.allocator import init_state

    config, rows = HYBRID, jnp.arange(HYBRID.max_num_seqs, dtype=jnp.int32)
    jaxpr = jax.make_jaxpr(
        lambda state: allocate_slots.__wrapped__(config, state, rows, rows, rows, defer_rest=defer_rest,
                                                 first_chunk_multi_block=first_chunk_multi_block)  # fmt: skip
    )(init_state(config))
    found = device_dependent_control_flow(jaxpr.jaxpr)
    assert (found == []) == defer_rest, found


def test_free_has_no_loop_or_branch_on_device_values():
    from jax_hybrid_attn.allocator import init_state, step

    rows = jnp.arange(HYBRID.max_num_seqs, dtype=jnp.int32)
    jaxpr = jax.make_jaxpr(lambda state: step.free.__wrapped__(HYBRID, state, rows))(init_state(HYBRID))
    assert device_dependent_control_flow(jaxpr.jaxpr) == []


def test_free_compacts_a_full_ring_as_the_cpu_does_with_the_gpu_path(monkeypatch):
    """On a GPU `free` always computes the ring compaction and selects it when the ring would overflow; on the CPU
    the compaction runs behind a loop. Each request hits 8 cached blocks of the free queue (8 stale entries) and
    frees 9: the ring of 32 overflows every third free. Both ways give the same state after every free."""
    from jax_hybrid_attn.allocator import pool as pool_ops
    from jax_hybrid_attn.allocator import step, xla_cpu

    config = make_config([full(4)], num_blocks=16, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)

    def run():
        mirror, states, overflows = Mirror(config), [], 0
        for i in range(7):
            mirror.add(f"r{i}", list(range(32)) + [100 + i])
            mirror.schedule([(f"r{i}", 33)])
            pool = mirror.manager.state.pool
            span, num_free = int(pool.ring_span), int(pool.num_free)
            mirror.free(f"r{i}")
            added = int(mirror.manager.state.pool.num_free) - num_free
            overflows += span + added > config.ring_capacity
            states.append(state_leaves(mirror.manager))
        return states, overflows

    on_cpu, overflows = run()
    assert overflows == 2
    monkeypatch.setattr(pool_ops, "run_or_select", xla_cpu.run_and_select)
    free = step.free.__wrapped__
    monkeypatch.setattr(step, "free", jax.jit(lambda *args: free(*args), static_argnums=0))  # a new trace
    on_gpu, _ = run()
    for cpu_leaves, gpu_leaves in zip(on_cpu, on_gpu, strict=True):
        for cpu_leaf, gpu_leaf in zip(cpu_leaves, gpu_leaves, strict=True):
            np.testing.assert_array_equal(cpu_leaf, gpu_leaf)
