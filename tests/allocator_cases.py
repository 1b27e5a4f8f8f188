"""Shared configurations and checks of the allocator tests: small configs, an oracle mirror, invariants."""

import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager
from jax_hybrid_attn.allocator.step import allocate_slots
from jax_hybrid_attn.allocator.columns import HASHED, MAP_SLOT
from jax_hybrid_attn.allocator.config import SLIDING_WINDOW

from .allocator_oracle import Oracle

LAYER = dict(num_kv_heads=1, head_size=4, dtype=jnp.float32)


def full(block_size):
    return FullAttentionSpec(block_size=block_size, **LAYER)


def window(block_size, sliding_window):
    return SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window, **LAYER)


def chunked(block_size, chunk):
    return ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=chunk, **LAYER)


def make_config(specs, **options) -> AllocatorConfig:
    defaults = dict(num_blocks=40, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)
    return AllocatorConfig(specs=tuple(specs), **{**defaults, **options})


# Shared by the rule tests and the trace tests (each config compiles the step once per test process).
CONFIGS = {
    # one full, two identical window groups (looked up together), one chunked-local; block 4
    "hybrid": make_config([full(4), window(4, 7), window(4, 7), chunked(4, 8)], num_blocks=40),
    # different block sizes (lcm 8, hash block 4): window caching only at segment tails; token verification
    "mixed_block_sizes": make_config(
        [full(8), window(4, 3)], num_blocks=24, max_model_len=48, verify_hits=True
    ),
    # no prefix caching (every freed block goes to the head of the queue); allocate only in-window blocks
    "no_cache_in_window": make_config(
        [full(4), window(4, 6)],
        num_blocks=30,
        enable_caching=False,
        sliding_window_in_window_only=True,
        max_num_lookahead_tokens=3,
    ),
    "in_window_cached": make_config(
        [window(2, 5), full(2)], num_blocks=48, sliding_window_in_window_only=True
    ),
    # a one-block token budget and a small pool: a new request's prefix hits (often at the head of the free queue)
    # outnumber the blocks one step may take, so the stale entries they leave fill the take window
    "small_budget": make_config([full(4), window(4, 8)], num_blocks=16, max_num_batched_tokens=4),
}


def oracle_for(config: AllocatorConfig) -> Oracle:
    return Oracle(
        kinds=config.kinds,
        block_sizes=config.block_sizes,
        windows=config.sliding_windows,
        chunks=config.chunk_sizes,
        num_blocks=config.num_blocks,
        max_model_len=config.max_model_len,
        caps=config.admission_caps,
        enable_caching=config.enable_caching,
        in_window_only=config.sliding_window_in_window_only,
    )


class Mirror:
    """A `KVCacheManager` and an `Oracle` driven together; `check` compares them and the invariants."""

    def __init__(self, config: AllocatorConfig):
        self.config = config
        self.manager = KVCacheManager(config)
        self.oracle = oracle_for(config)
        self.deferred_rows = self.served_deferring_rows = 0  # rows the deferring steps deferred, and served

    def add(self, request_id, tokens):
        slot = self.manager.add_request(request_id, tokens)
        self.oracle.add_request(slot, tokens)

    def append(self, request_id, tokens):
        self.manager.append_token_ids(request_id, tokens)
        self.oracle.append(self.manager._slot(request_id), tokens)

    def schedule(self, batch, lookahead=None, must_fit=None):
        """batch: [(request_id, num_new_tokens)] in row order. Returns the manager's StepOutput."""
        before = {rid: self.manager.num_computed_tokens(rid) for rid, _ in batch}
        out = self.manager.schedule(batch, num_lookahead_tokens=lookahead, full_sequence_must_fit=must_fit)
        for row, (rid, count) in enumerate(batch):
            slot = self.manager._slot(rid)
            la = 0 if lookahead is None else lookahead[row]
            fit = False if must_fit is None else must_fit[row]
            ok, computed, scheduled = self.oracle.allocate(slot, before[rid], count, la, fit)
            got = (
                bool(out.success[row]),
                int(out.num_computed_tokens[row]),
                int(out.num_scheduled_tokens[row]),
            )
            want = (ok, computed if ok else got[1], scheduled)
            assert got == want, f"row {row} {rid!r}: allocator {got}, oracle {(ok, computed, scheduled)}"
        self.check()
        return out

    def schedule_deferring(self, batch, lookahead, must_fit):
        """One deferring step as the engine sends a prefill step (`allocate_slots` with ``defer_rest`` and
        ``first_chunk_multi_block``): a deferred row changes nothing, so the oracle runs only the other rows."""
        manager, config = self.manager, self.config
        before = {rid: manager.num_computed_tokens(rid) for rid, _ in batch}
        pad = config.max_num_seqs - len(batch)
        columns = ([manager._slot(rid) for rid, _ in batch] + [-1] * pad, [before[rid] for rid, _ in batch] + [0] * pad,
                   [count for _, count in batch] + [0] * pad, list(lookahead) + [0] * pad)  # fmt: skip
        manager.state, out = allocate_slots(config, manager.state, *(jnp.array(c, jnp.int32) for c in columns),
                                            jnp.array(list(must_fit) + [False] * pad), defer_rest=True,
                                            first_chunk_multi_block=True)  # fmt: skip
        for row, (rid, count) in enumerate(batch):
            if out.deferred[row]:
                assert not out.success[row] and int(out.num_scheduled_tokens[row]) == 0
                self.deferred_rows += 1
                continue
            ok, computed, scheduled = self.oracle.allocate(manager._slot(rid), before[rid], count, lookahead[row],
                                                           must_fit[row])  # fmt: skip
            got = (bool(out.success[row]), int(out.num_computed_tokens[row]), int(out.num_scheduled_tokens[row]))
            assert got == (ok, computed if ok else got[1], scheduled), f"row {row} {rid!r}: oracle {ok, computed}"
            if ok:
                manager._num_computed[rid] = int(out.seq_lens[row])
                self.served_deferring_rows += 1
        self.check()
        return out

    def free(self, request_id):
        self.free_requests([request_id])

    def free_requests(self, request_ids):
        """One device call for all of them; the oracle frees them one at a time, in order."""
        slots = [self.manager._slot(request_id) for request_id in request_ids]
        if len(request_ids) == 1:
            self.manager.free(request_ids[0])
        else:
            self.manager.free_requests(request_ids)
        for slot in slots:
            self.oracle.free_request(slot)
        self.check()

    def preempt(self, request_id):
        slot = self.manager._slot(request_id)
        self.manager.preempt(request_id)
        self.oracle.free_request(slot)
        self.check()

    def reset(self):
        assert self.manager.reset_prefix_cache() == self.oracle.reset_prefix_cache()
        self.check()

    def check(self):
        manager, oracle = self.manager, self.oracle
        assert manager.free_block_queue() == oracle.free
        pool = manager.state.pool
        np.testing.assert_array_equal(np.asarray(pool.ref_counts)[1:], oracle.ref[1:])
        hashed = np.asarray(pool.block_hashed)
        assert [b for b in range(1, self.config.num_blocks) if hashed[b]] == [
            b for b in range(1, self.config.num_blocks) if oracle.key_of[b] is not None
        ]
        for rid, slot in manager._slot_of.items():
            want = oracle.blocks.get(slot)
            got = manager.get_block_ids(rid)
            if want is None:
                assert all(len(lst) == 0 for lst in got), f"{rid!r} holds {got} but is not running"
            else:
                assert got == want, f"{rid!r}: allocator {got}, oracle {want}"
        assert manager.get_num_common_prefix_blocks() == oracle.num_common_prefix_blocks()
        stats = manager.state.stats  # lookups, tokens queried, tokens hit, as vLLM's prefix-cache stats count them
        assert [int(stats.requests), int(stats.queries), int(stats.hits)] == oracle.stats
        check_invariants(manager)


def check_invariants(manager: KVCacheManager):
    """The properties of the issue: free + used = total - 1; a block is in as many tables as its count says;
    the null block is never free; window requests stay within their cap; every id is in range."""
    config, state = manager.config, manager.state
    num_blocks = config.num_blocks
    ref = np.asarray(state.pool.ref_counts)
    free_pos = np.asarray(state.pool.free_pos)
    queue = manager.free_block_queue()
    used = int(np.sum(ref[1:] > 0))
    assert int(state.pool.num_free) == len(queue) == len(set(queue))
    assert len(queue) + used == num_blocks - 1
    assert 0 not in queue and free_pos[0] < 0
    assert all(ref[b] == 0 for b in queue)
    occurrences = np.zeros(num_blocks, np.int64)
    tables = np.asarray(state.requests.tables)
    lengths = np.asarray(state.requests.num_table_blocks)
    running = np.asarray(state.requests.running)
    for slot in range(config.max_num_seqs):
        for g in range(config.num_groups):
            row = tables[g, slot]
            assert np.all((row >= 0) & (row < num_blocks))
            assert np.all(row[lengths[g, slot] :] == 0)
            if not running[slot]:
                assert lengths[g, slot] == 0
            # `take` never hands out the null block: past the leading nulls every entry is a real block.
            num_null = np.asarray(state.requests.num_null)[g, slot]
            assert np.all(row[num_null : lengths[g, slot]] != 0), f"null block inside a table: {row}"
            real = row[row != 0]
            assert len(set(real.tolist())) == len(real), f"block twice in one table: {row}"
            np.add.at(occurrences, real, 1)
            if config.kinds[g] == SLIDING_WINDOW:
                assert len(real) <= config.admission_caps[g], (len(real), config.admission_caps[g])
    np.testing.assert_array_equal(occurrences[1:], ref[1:])
    # The prefix map holds exactly the hashed blocks, each at its slot; each bucket's bit mask matches its slots.
    info, table = np.asarray(state.pool.info), np.asarray(state.pool.prefix_map)
    width = table.shape[1] - 1
    hashed = info[:, HASHED] != 0
    slots = info[:, MAP_SLOT]
    assert np.all(slots[~hashed] == -1) and np.all(slots[1:][hashed[1:]] >= 0)
    in_map = table[:, :width][table[:, :width] >= 0]
    assert sorted(in_map.tolist()) == sorted(np.nonzero(hashed)[0].tolist())
    for block in np.nonzero(hashed)[0]:
        assert table[slots[block] // width, slots[block] % width] == block
    bits = ((table[:, :width] >= 0) << np.arange(width)).sum(axis=1)
    np.testing.assert_array_equal(bits, table[:, width])
