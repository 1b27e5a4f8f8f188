"""Ahead-of-time compiled allocator steps: one task per operation on a CPU, the same results as `allocate_slots`."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn.allocator import (
    allocate_slots,
    append_token_ids,
    compile_allocate_slots,
    compile_single_task,
    init_state,
)

from .allocator_cases import CONFIGS


def split_operations(compiled: jax.stages.Compiled) -> int:
    """Operations that XLA's CPU compiler split into several parallel tasks."""
    partitions = re.findall(r'"outer_dimension_partitions":\[([^\]]*)\]', compiled.as_text())
    return sum(1 for p in partitions if np.prod([int(n.strip('"')) for n in p.split(",") if n]) > 1)


def test_single_task_compile_splits_no_gather_and_keeps_the_callers_affinity():
    table = jnp.asarray(np.random.default_rng(0).integers(0, 1 << 20, (200_000, 8)), jnp.int32)  # 6.4 MB
    rows = jnp.asarray(np.random.default_rng(1).integers(0, 200_000, 384), jnp.int32)
    affinity = os.sched_getaffinity(0)

    def lower(offset):  # another module for each offset: the session's JAX cache keys executables by module
        return jax.jit(lambda table, rows: table[rows] + offset).lower(table, rows)

    one_task = compile_single_task(lower(1), platform="cpu")

    assert os.sched_getaffinity(0) == affinity
    assert split_operations(one_task) == 0
    np.testing.assert_array_equal(one_task(table, rows), np.asarray(table)[np.asarray(rows)] + 1)
    if len(affinity) >= 2:  # the plain compile splits this gather: the pinned thread is what removes it
        assert split_operations(lower(2).compile()) > 0


def test_compiled_step_equals_the_jitted_step():
    """Decode steps of a hybrid config through both, including a reused output: frees, takes, caching, and rows
    that no longer fit once the pool runs out."""
    config = CONFIGS["hybrid"]
    slots = jnp.arange(config.max_num_seqs, dtype=jnp.int32)
    ones = jnp.ones_like(slots)
    prompts = jnp.asarray(np.random.default_rng(2).integers(1, 1000, (config.max_num_seqs, 6)), jnp.int32)
    counts = jnp.array([6, 5, 3, 6], jnp.int32)

    def prefilled():
        state = append_token_ids(config, init_state(config), slots, prompts, counts)
        return allocate_slots(config, state, slots, jnp.zeros_like(slots), counts)

    (state, out), (state_c, out_c) = prefilled(), prefilled()
    step = compile_allocate_slots(config, state_c, slots, out_c.seq_lens, ones)
    reusing = compile_allocate_slots(config, state_c, slots, out_c.seq_lens, ones, previous_output=out_c)
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 1000, (12, config.max_num_seqs, 1)), jnp.int32)
    served = []
    for i in range(12):  # every request crosses block edges, window and chunk boundaries
        state = append_token_ids(config, state, slots, tokens[i], ones)
        state_c = append_token_ids(config, state_c, slots, tokens[i], ones)
        state, out = allocate_slots(config, state, slots, out.seq_lens, ones)
        if i % 2:  # out_c is donated: its seq_lens must not be an argument too
            computed = jnp.array(out_c.seq_lens, copy=True)
            state_c, out_c = reusing(state_c, slots, computed, ones, previous_output=out_c)
        else:
            state_c, out_c = step(state_c, slots, out_c.seq_lens, ones)
        served.append(np.asarray(out.success))
        for got, want in zip(jax.tree.leaves((state_c, out_c)), jax.tree.leaves((state, out))):
            np.testing.assert_array_equal(got, want)

    served = np.sum(served, axis=1)
    assert (
        served[0] == config.max_num_seqs and served[-1] < config.max_num_seqs
    )  # the pool ran out on the way
    assert compile_allocate_slots(config, state_c, slots, out_c.seq_lens, ones).as_text() == step.as_text()


def test_batched_add_and_free_equal_one_request_per_call():
    """`add_requests` / `free_requests` (one device call per batch, rows padded to a compiled batch size) leave the
    same state as `add_request` / `free` one request at a time, compiled or not; a bad batch changes nothing."""
    from jax_hybrid_attn.allocator import KVCacheManager

    config = CONFIGS["hybrid"]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(1, 7, config.max_num_seqs)]
    ids = [f"r{i}" for i in range(len(prompts))]
    one, batched, compiled = KVCacheManager(config), KVCacheManager(config), KVCacheManager(config)
    compiled.compile()
    for request_id, prompt in zip(ids, prompts, strict=True):
        one.add_request(request_id, prompt)
    for manager in (batched, compiled):
        assert manager.add_requests(ids[:1], prompts[:1]) == [one._slot_of[ids[0]]]  # the same slot
        manager.add_requests(ids[1:], prompts[1:])
    for manager in (one, batched, compiled):
        for request_id, prompt in zip(ids, prompts, strict=True):
            assert manager.allocate_slots(request_id, len(prompt)) is not None
    want = jax.tree.map(np.asarray, one.state)
    for manager in (batched, compiled):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, manager.state), want)

    before = jax.tree.map(np.asarray, batched.state)
    for bad in ([ids[0], "new"], ["new", "new"]):  # already added; twice in one batch
        with pytest.raises(ValueError, match="is already added"):
            batched.add_requests(bad, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"token_ids must give one prompt per request \(2\)"):
        batched.add_requests(["x", "y"], [[1, 2]])
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        batched.add_requests(["x", "y"], [[1, 2], []])
    with pytest.raises(ValueError, match="names a request twice"):
        batched.free_requests([ids[0], ids[0]])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, batched.state), before)

    one.free(ids[2])
    one.free(ids[0])
    for manager in (batched, compiled):
        manager.free_requests([ids[2], ids[0]])
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, manager.state),
                     jax.tree.map(np.asarray, one.state))  # fmt: skip
        assert manager.free_block_queue() == one.free_block_queue()
