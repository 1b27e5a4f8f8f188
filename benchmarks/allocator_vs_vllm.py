"""Our jitted allocator step against vLLM 0.33's Python `KVCacheManager`, side by side in one process, same work.

The setting of `allocator_step.py`: a Gemma-3-like model (1 full-attention + 5 sliding-window groups, window 1,024,
block 16, prefix caching on), 256 running decode requests with the same random 2,000-4,000-token prompts on both
sides, prefilled two at a time as there. Each timed scheduler step computes one token per request:
  * vLLM: ``KVCacheManager.allocate_slots(request, 1)`` for the 256 requests, in order, then the new block ids of
    each (``get_block_ids(allow_none=True)``, which the scheduler sends to the worker): the KV-cache manager's work
    in a decode step of the scheduler (``allocate_slots`` alone is printed too);
  * ours: one `allocate_slots` call for the 256 rows, outputs ready (`jax.block_until_ready`), compiled by
    `compile_allocate_slots` (one task per operation on a CPU; see `jax_hybrid_attn.allocator.xla_cpu`).
The two take turns of `--block` steps (10 by default; the first side changes every turn), so that the machine's
noise hits both alike: the figure to read is the ratio. Each step starts, untimed, with the token each request
sampled (the same tokens on both sides): vLLM's block hasher and our `append_token_ids` hash a block when it fills.
``--sync-dispatch`` runs our calls inline on the calling thread (JAX's `jax_cpu_enable_async_dispatch` off: a
scheduler waits for each step's result anyway; on 2 cores the hand-off to a worker thread shows in the figures).
With ``--block 1`` the sides alternate every step, and each step runs after the other side's (its caches cold;
see benchmarks/RESULTS.md for what that costs). At the end, every request's block ids in every group
must be the same on both sides: the two allocators did the same work, block for block.

vLLM 0.33 pins another torch than this project, so it runs in its own environment (see BUILD.md):

    python3.12 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm==0.33.0 -e .
    .venv-vllm/bin/python benchmarks/allocator_vs_vllm.py [--steps 100]   # from the repository root

Pin 2 cores (``taskset -c 0,1``) to compare with a 2-core machine.
"""

import argparse
import os
import sys
import time

# One torch thread, as vLLM's engine runs for serving (`vllm.utils.torch_utils.set_torch_threads_for_runtime`): set
# before torch is imported, or its idle OpenMP threads spin and take cycles from both sides (see
# benchmarks/RESULTS.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allocator_step import BLOCK, decode_prompts, running_decodes  # noqa: E402
from vllm_peer import request_factory, vllm_kv_cache_manager  # noqa: E402

from jax_hybrid_attn.allocator import append_token_ids, compile_allocate_slots  # noqa: E402


def vllm_manager(config, lengths, tokens):
    """vLLM's `KVCacheManager` for `config`'s groups and pool, with the requests of `running_decodes` in the same
    state: (manager, requests)."""
    manager = vllm_kv_cache_manager(config)
    make_request = request_factory(BLOCK)
    requests = [make_request(str(r), tokens[r, :n].tolist()) for r, n in enumerate(lengths)]
    for start in range(0, len(requests), 2):  # as `running_decodes`: two prompts, then their first decode
        pair = requests[start : start + 2]
        for request in pair:
            hits, num_hit_tokens, _ = manager.get_computed_blocks(request, request.num_tokens - 1)
            new = request.num_tokens - 1 - num_hit_tokens
            if manager.allocate_slots(request, new, num_hit_tokens, hits) is None:
                raise RuntimeError("vLLM: a prefill did not fit")
        for request in pair:
            request.num_computed_tokens = request.num_tokens - 1
        for request in pair:
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("vLLM: a decode did not fit")
            request.num_computed_tokens += 1
    return manager, requests


def check_same_blocks(config, state, manager, requests):
    """Every request's block ids, group by group, are the same in both allocators. Returns the blocks compared."""
    tables = np.asarray(state.requests.tables)
    lengths = np.asarray(state.requests.num_table_blocks)  # [G, R]
    compared = 0
    for r, request in enumerate(requests):
        for g, theirs in enumerate(manager.get_block_ids(request.request_id)):
            ours = tables[g, r, : lengths[g, r]].tolist()
            if ours != list(theirs):
                raise AssertionError(
                    f"request {r}, group {g}: ours {ours[-4:]}..., vLLM {list(theirs)[-4:]}..."
                )
            compared += len(ours)
    return compared


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--block",
        type=int,
        default=10,
        help="steps each side runs before the other's turn (1: alternate every step)",
    )
    parser.add_argument(
        "--sync-dispatch",
        action="store_true",
        help="run each jitted call inline on the calling thread (jax_cpu_enable_async_dispatch=False)",
    )
    args = parser.parse_args()
    if args.sync_dispatch:  # read when the CPU client is created: before any array exists
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    num_requests, warmup = args.requests, 5
    config, state, computed = running_decodes(num_requests)
    lengths, tokens = decode_prompts(num_requests, max_model_len=config.max_model_len)
    manager, requests = vllm_manager(config, lengths, tokens)
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    ones = jnp.ones(num_requests, jnp.int32)
    append = jax.jit(
        lambda state, sampled: append_token_ids(config, state, slots, sampled, ones), donate_argnums=0
    )

    # Our step as users run it on a CPU: compiled ahead of time with one task per operation.
    allocate = compile_allocate_slots(
        config, state, slots, computed, ones, num_tokens=num_requests, return_block_tables=False
    )

    def ours(sampled):
        nonlocal state, computed
        state = append(state, jnp.asarray(sampled[:, None], jnp.int32))
        jax.block_until_ready(state)
        start = time.perf_counter()
        state, out = allocate(state, slots, computed, ones)
        jax.block_until_ready((state, out))
        elapsed = time.perf_counter() - start
        if not bool(jnp.all(out.success)):
            raise RuntimeError("ours: a decode did not fit")
        computed = computed + 1
        return elapsed

    def theirs(sampled):
        for request, token in zip(requests, sampled.tolist()):
            request.append_output_token_ids(token)
        start = time.perf_counter()
        new_blocks = [manager.allocate_slots(request, 1) for request in requests]
        allocated = time.perf_counter()
        if any(blocks is None for blocks in new_blocks):
            raise RuntimeError("vLLM: a decode did not fit")
        [
            blocks.get_block_ids(allow_none=True) for blocks in new_blocks
        ]  # what the scheduler sends the worker
        elapsed = time.perf_counter() - start
        for request in requests:
            request.num_computed_tokens += 1
        return elapsed, allocated - start

    # The tokens each request samples at each step, the same on both sides.
    sampled = np.random.default_rng(1).integers(0, 256_000, (warmup + args.steps, num_requests))
    times = {"ours": [], "vLLM": [], "vLLM allocate_slots only": []}
    turn_ratios = []  # vLLM's median over ours in each pair of adjacent turns: the host's slow drifts cancel
    sides = (("ours", ours), ("vLLM", theirs))
    for first in range(0, warmup + args.steps, args.block):
        steps = range(first, min(first + args.block, warmup + args.steps))
        turn = {}
        for name, run in sides if first // args.block % 2 == 0 else sides[::-1]:
            turn[name] = []
            for step in steps:
                elapsed = run(sampled[step])
                if step < warmup:
                    continue
                if name == "vLLM":
                    elapsed, allocate_only = elapsed
                    times["vLLM allocate_slots only"].append(allocate_only)
                times[name].append(elapsed)
                turn[name].append(elapsed)
        if turn["ours"]:
            turn_ratios.append(np.median(turn["vLLM"]) / np.median(turn["ours"]))
    compared = check_same_blocks(config, state, manager, requests)

    median = {name: 1e6 * float(np.median(t)) for name, t in times.items()}
    device = jax.devices()[0]
    print(
        f"| allocator step, {num_requests} decode requests | median us | p10 us | p90 us |\n|---|---|---|---|"
    )
    for name, t in times.items():
        p10, p90 = (1e6 * float(np.percentile(t, q)) for q in (10, 90))
        print(f"| {name} | {median[name]:.0f} | {p10:.0f} | {p90:.0f} |")
    print(
        f"ours on {device.platform} ({device.device_kind}), vLLM on the host, {os.cpu_count()} CPUs visible, affinity "
        f"{len(os.sched_getaffinity(0))}, {args.steps} steps each, in turns of {args.block}"
        f"{', sync dispatch' if args.sync_dispatch else ''}: ours "
        f"{median['vLLM'] / median['ours']:.1f}x faster (ratio of medians; median of the {len(turn_ratios)} turn pairs' "
        f"ratios {np.median(turn_ratios):.1f}x, 10th-90th percentile {np.percentile(turn_ratios, 10):.1f}-"
        f"{np.percentile(turn_ratios, 90):.1f}x); "
        f"block ids identical for all {num_requests} requests x {config.num_groups} groups ({compared} blocks)"
    )


if __name__ == "__main__":
    main()
