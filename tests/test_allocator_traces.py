"""Random traces of add / allocate (prefill chunks, decode, prefix hits, lookahead, admission gate) / append /
free (one request or several per call) / preempt / reset, run on the jitted allocator and on the plain-Python
oracle of vLLM's rules: same success flags, block tables, reference counts, hashes and free-queue order after every
step, and the invariants (free + used = total - 1, a block in as many tables as its count, null block never free,
window requests within their cap, ids in range)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .allocator_cases import CONFIGS, Mirror, full, make_config

VOCAB = 5  # few token ids and shared prefixes, so that prefix hits and equal hashes happen


PROMPT_PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 0, 1, 2, 3], [1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 4, 4], [4] * 12)


def run_trace(config, seed: int, num_ops: int = 30, *, deferring: bool = False):
    """A random trace (mostly steps) from `seed`, run on the allocator and the oracle together; with `deferring`,
    about half the steps are deferring prefill steps (`Mirror.schedule_deferring`). Returns the mirror."""
    rng = random.Random(seed)
    mirror = Mirror(config)
    manager = mirror.manager
    ids = iter(range(10_000))
    live, prompts = [], []
    for _ in range(num_ops):
        kind = rng.choices(["add", "step", "append", "free", "preempt", "reset"], [3, 8, 3, 1, 1, 0.3])[0]
        if len(live) < 2:
            kind = "add"
        if kind == "add" and len(live) < config.max_num_seqs:
            if prompts and rng.random() < 0.3:  # the same prompt again: prefix hits on freed blocks
                prompt = rng.choice(prompts)
            else:
                tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
                prompt = (rng.choice(PROMPT_PREFIXES) + tail)[: config.max_model_len - 8]
                prompts.append(prompt)
            rid = next(ids)
            mirror.add(rid, prompt)
            live.append(rid)
        elif kind == "step":
            batch, lookahead, must_fit, budget = [], [], [], config.max_num_batched_tokens
            for rid in rng.sample(live, rng.randint(1, len(live))):
                left = manager.num_tokens(rid) - manager.num_computed_tokens(rid)
                if left <= 0 or budget <= 0:
                    continue
                count = min(rng.choice([1, 1, 2, left, left, rng.randint(1, left)]), budget)
                budget -= count
                batch.append((rid, count))
                lookahead.append(rng.randint(0, config.max_num_lookahead_tokens))
                must_fit.append(rng.random() < 0.2)
            if batch and deferring and rng.random() < 0.5:
                mirror.schedule_deferring(batch, lookahead, must_fit)
            elif batch:
                mirror.schedule(batch, lookahead, must_fit)
        elif kind == "append":
            for rid in live:
                done = manager.num_computed_tokens(rid) == manager.num_tokens(rid)
                if done and manager.num_tokens(rid) < config.max_model_len - 3:
                    mirror.append(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 2))])
        elif kind == "free":  # one request, or several in one call (prefix blocks they share drop a reference each)
            mirror.free_requests([live.pop(rng.randrange(len(live))) for _ in range(rng.randint(1, len(live) - 1))])
        elif kind == "preempt":
            mirror.preempt(rng.choice(live))
        elif kind == "reset":
            mirror.reset()
    mirror.free_requests(live)
    assert manager.num_free_blocks == config.num_blocks - 1
    return mirror


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_trace_matches_oracle_and_keeps_invariants(name, seed):
    run_trace(CONFIGS[name], seed)


@pytest.mark.parametrize("name", ["hybrid", "mixed_block_sizes", "no_cache_in_window"])
def test_deferring_prefill_steps_match_the_oracle_on_the_rows_they_serve(name):
    """Deferring steps with a multi-block first chunk, among full ones: the rows they serve (prefill chunks, new
    requests that surely miss, decodes freeing several blocks) are what vLLM's rules give, the rows they defer
    change nothing."""
    served = deferred = 0
    for seed in range(2):
        mirror = run_trace(CONFIGS[name], seed, deferring=True)
        served, deferred = served + mirror.served_deferring_rows, deferred + mirror.deferred_rows
    assert served > 0 and deferred > 0, (served, deferred)


def test_long_decode_trace_with_shared_prefixes():
    """Four requests share a prompt prefix, prefill in chunks, then decode past many block and window edges."""
    config = CONFIGS["hybrid"]
    mirror = Mirror(config)
    prompts = {rid: [1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 4] + [rid] * (3 + rid) for rid in range(4)}
    for rid, prompt in prompts.items():
        mirror.add(rid, prompt)
    mirror.schedule([(0, 8), (1, 6)])
    mirror.schedule([(0, 6), (1, 9), (2, 5)])  # 0 and 1 finish their prompts; 2 hits 0's blocks
    mirror.schedule([(2, 16), (3, 16)])
    for step in range(30):
        batch = []
        for rid in range(4):
            if mirror.manager.num_computed_tokens(rid) == mirror.manager.num_tokens(rid):
                mirror.append(rid, [(step + rid) % 5])
            batch.append((rid, 1))
        mirror.schedule(batch)
    for rid in range(4):
        mirror.free(rid)


def run_prefix_churn(config, seed: int, num_requests: int = 14):
    """Requests that mostly repeat earlier prompts arrive, prefill in budget-sized chunks beside each other, and
    leave: their cached blocks go back to the free queue and the next request hits them there."""
    rng = random.Random(seed)
    mirror = Mirror(config)
    manager = mirror.manager
    prompts, live = [], []
    for rid in range(num_requests):
        if prompts and rng.random() < 0.7:
            prompt = rng.choice(prompts)
        else:
            prompt = PROMPT_PREFIXES[-2] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
            prompts.append(prompt)
        if len(live) == config.max_num_seqs:
            mirror.free(live.pop(rng.randrange(len(live))))
        mirror.add(rid, prompt)
        live.append(rid)
        for _ in range(rng.randint(1, 3)):
            batch, budget = [], config.max_num_batched_tokens
            for request in live:
                left = manager.num_tokens(request) - manager.num_computed_tokens(request)
                if left > 0 and budget > 0:
                    batch.append((request, min(left, budget)))
                    budget -= batch[-1][1]
            if batch:
                mirror.schedule(batch)
        if rng.random() < 0.5:
            mirror.free(live.pop(rng.randrange(len(live))))
    for rid in live:
        mirror.free(rid)


@pytest.mark.parametrize("seed", [0, 1, 29])  # 29 handed out the null block before the touch-first fix
def test_prefix_hits_from_the_head_of_the_free_queue(seed):
    """Prefix hits on blocks at the head of the free queue, with a take window smaller than the hits: the stale
    entries the hits leave never reach a request's table as the null block."""
    run_prefix_churn(CONFIGS["small_budget"], seed)


def test_hits_that_fill_the_take_window_do_not_hand_out_the_null_block():
    """The reduced case: four hit blocks at the head of the free queue, one new block to take (vLLM: block 6)."""
    config = make_config([full(16)], num_blocks=7, max_model_len=128, max_num_batched_tokens=16)
    mirror = Mirror(config)
    prompt = list(range(1, 65))
    mirror.add("C", [1000 + i for i in range(5)])
    mirror.schedule([("C", 5)])
    mirror.add("A", prompt)
    for _ in range(4):
        mirror.schedule([("A", 16)])
    mirror.add("D", [2000 + i for i in range(16)])
    mirror.schedule([("D", 16)])
    mirror.free("A")
    mirror.free("D")
    mirror.add("B", prompt + [3000 + i for i in range(10)])
    mirror.schedule([("B", 16)])
    assert mirror.manager.get_block_ids("B") == [[2, 3, 4, 5, 6]]
    assert mirror.manager.num_free_blocks == 0 == len(mirror.manager.free_block_queue())
