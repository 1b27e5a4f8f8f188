"""Time the jitted allocator step on a Gemma-3-like model: 256 running decode requests, 2-4k-token contexts.

Configuration: 1 full-attention group + 5 sliding-window groups (window 1,024), block 16, prefix caching on.
Each timed step is one `allocate_slots` call for the 256 requests (one new token each: new blocks, frees of
out-of-window blocks, caching of blocks that became full, slot mappings), after an untimed call that appends the
token each request sampled. Three variants: the block tables read from the state (persistent, rows = slots, as
vLLM's model runner keeps them; the work vLLM's KVCacheManager does), the block tables gathered per row into the
output, and append + allocate in one call. The first three run the step as `compile_allocate_slots` compiles it
(one task per operation on a CPU), the fused one as plain `jax.jit`. Compile time is excluded; figures are medians over the steps, with
`jax.block_until_ready`. Runs unchanged on CPU and GPU (pin 2 cores with `taskset -c 0,1` to compare with a
2-core machine):

    PYTHONPATH=. python benchmarks/allocator_step.py [--steps 300] [--requests 256]

`allocator_vs_vllm.py` times vLLM 0.33's Python `KVCacheManager` on the same work, side by side; the figures of
both are in benchmarks/RESULTS.md. Also printed: blocks held per request at a 32,768-token context against
full-attention allocation.
"""

import argparse
import math
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import FullAttentionSpec, SlidingWindowSpec
from jax_hybrid_attn.allocator import (
    AllocatorConfig,
    add_requests,
    allocate_slots,
    append_token_ids,
    compile_allocate_slots,
    free,
    init_state,
)

VLLM_MS = (7.1, 7.7)
WINDOW, BLOCK = 1024, 16
LAYER = dict(block_size=BLOCK, num_kv_heads=8, head_size=256, dtype=jnp.bfloat16)


def gemma3_like_specs(num_window_groups: int = 5):
    return (FullAttentionSpec(**LAYER),) + (
        SlidingWindowSpec(**LAYER, sliding_window=WINDOW),
    ) * num_window_groups


def make_config(
    num_requests: int, *, max_num_batched_tokens: int, max_model_len: int = 8192
) -> AllocatorConfig:
    per_request = math.ceil(max_model_len / BLOCK) + 5 * (
        math.ceil((WINDOW - 1 + max_num_batched_tokens) / BLOCK) + 1
    )
    return AllocatorConfig(
        specs=gemma3_like_specs(),
        num_blocks=num_requests * per_request // 2 + 1,  # room for about half the worst case: 2-4k contexts
        max_num_seqs=num_requests,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def decode_prompts(num_requests: int, *, max_model_len: int, seed: int = 0):
    """The prompts of `running_decodes`: lengths [R] (2,000-4,000 tokens) and token ids [R, max_model_len] (request
    r's prompt is ``tokens[r, :lengths[r]]``), as NumPy arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2000, 4001, num_requests)
    return lengths, rng.integers(0, 256_000, (num_requests, max_model_len)).astype(np.int32)


def running_decodes(num_requests: int, *, max_num_batched_tokens: int = 2048, seed: int = 0):
    """The benchmark's setting: (config, state, num_computed_tokens) with `num_requests` running requests of
    random 2,000-4,000-token contexts, each prefilled then decoded once (which frees its out-of-window blocks).
    The prefill runs under a config of the same state shapes with a big token budget."""
    config = make_config(num_requests, max_num_batched_tokens=max_num_batched_tokens)
    prefill_config = AllocatorConfig(
        specs=config.specs,
        num_blocks=config.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=8192,
    )
    lengths, tokens = decode_prompts(num_requests, max_model_len=config.max_model_len, seed=seed)
    state = init_state(config)
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    state = add_requests(config, state, slots, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32))
    for start in range(0, num_requests, 2):  # two prompts per step, then their first decode step
        rows = jnp.asarray([start, start + 1], jnp.int32)
        prompt = jnp.asarray(lengths[start : start + 2] - 1, jnp.int32)
        state, out = allocate_slots(prefill_config, state, rows, jnp.zeros(2, jnp.int32), prompt)
        assert bool(jnp.all(out.success)), "prefill did not fit"
        state, out = allocate_slots(prefill_config, state, rows, prompt, jnp.ones(2, jnp.int32))
        assert bool(jnp.all(out.success)), "decode did not fit"
    return config, state, jnp.asarray(lengths, jnp.int32)


def time_steps(step, state, computed, *, steps: int, sample, warmup: int = 10, verify: bool = False):
    """Median and 10th percentile (us) of `step` over `steps` decode steps; a token is appended before each.

    With `verify`, every step is replayed on the CPU (outside the timing) and its outputs and state must be
    bit-identical to the timed device's.
    """
    times, failures = [], 0
    cpu = jax.devices("cpu")[0]
    copy_to_cpu = partial(jax.tree.map, lambda x: jnp.array(jax.device_put(x, cpu), copy=True))
    mirror = copy_to_cpu((state, computed)) if verify else None
    for i in range(steps + warmup):
        state = sample(state, i)
        jax.block_until_ready(state)
        start = time.perf_counter()
        state, out = step(state, computed)
        jax.block_until_ready((state, out))
        if i >= warmup:  # the first calls compile
            times.append(time.perf_counter() - start)
        failures += int(jnp.sum(~out.success))
        if mirror is not None:
            cpu_state, cpu_computed = mirror
            cpu_state, cpu_out = step(sample(cpu_state, i), cpu_computed)
            for name, a, b in (("state", state, cpu_state), ("outputs", out, cpu_out)):
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                    if not np.array_equal(np.asarray(x), np.asarray(y)):
                        raise AssertionError(f"step {i}: the {name} differs from the CPU's")
            mirror = (cpu_state, cpu_computed + 1)
        computed = computed + 1
    return state, computed, 1e6 * float(np.median(times)), 1e6 * float(np.percentile(times, 10)), failures


def plain_compile(config, state, *args, **kwargs):
    """`allocate_slots` compiled as a call of the jitted function compiles it (`compile_allocate_slots`' signature)."""
    return allocate_slots.lower(config, state, *args, **kwargs).compile()


NEW_PER_STEP, NEW_PROMPT = 4, 256


def time_mixed_steps(config, state, computed, *, steps: int, sample, warmup: int = 10):
    """Each step, 4 requests finish and 4 new ones with 256-token prompts take their slots (untimed: `free` and
    `add_requests`); the timed step prefills the new prompts (several blocks per group each, no prefix hit: the
    step's loop serves them together) and decodes the others. Median and 10th percentile (us), failed rows."""
    num_requests = computed.shape[0]
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    rng = np.random.default_rng(1)
    times, failures, step = [], 0, None
    for i in range(steps + warmup):
        new_slots = jnp.asarray((i * NEW_PER_STEP + np.arange(NEW_PER_STEP)) % num_requests, jnp.int32)
        prompts = np.zeros((NEW_PER_STEP, config.max_model_len), np.int32)
        prompts[:, :NEW_PROMPT] = rng.integers(0, 256_000, (NEW_PER_STEP, NEW_PROMPT))
        state = free(config, state, new_slots)
        state = add_requests(
            config, state, new_slots, jnp.asarray(prompts), jnp.full(NEW_PER_STEP, NEW_PROMPT, jnp.int32)
        )
        state = sample(state, i)  # new requests too: their prompt grows by one token
        computed = computed.at[new_slots].set(0)
        num_new = jnp.ones(num_requests, jnp.int32).at[new_slots].set(NEW_PROMPT)
        jax.block_until_ready((state, computed))
        if step is None:
            step = compile_allocate_slots(config, state, slots, computed, num_new, return_block_tables=False)
        start = time.perf_counter()
        state, out = step(state, slots, computed, num_new)
        jax.block_until_ready((state, out))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        failures += int(jnp.sum(~out.success))
        computed = out.seq_lens
    return 1e6 * float(np.median(times)), 1e6 * float(np.percentile(times, 10)), failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--only-persistent", action="store_true", help="time only the allocate-only variants")
    parser.add_argument("--verify", action="store_true", help="replay every step on the CPU and compare")
    parser.add_argument("--mixed", action="store_true", help="also time steps that admit new prompts")
    parser.add_argument(
        "--plain-jit",
        action="store_true",
        help="compile the step as jax.jit does (XLA's default task split on a CPU)",
    )
    args = parser.parse_args()
    num_requests = args.requests
    config, state, lengths = running_decodes(num_requests, max_num_batched_tokens=args.max_num_batched_tokens)
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    ones = jnp.ones(num_requests, jnp.int32)

    @partial(jax.jit, donate_argnums=0)
    def sample(state, i):  # the token each request sampled last step (untimed)
        tokens = jax.random.randint(jax.random.key(i), (num_requests, 1), 0, 256_000, dtype=jnp.int32)
        return append_token_ids(config, state, slots, tokens, ones)

    def allocate(return_block_tables, *, reuse_output=False):
        """The step as users run it: compiled ahead of time (`compile_allocate_slots`, one task per operation on a
        CPU), once per device and per reuse of the last output."""
        # The last output of each state (the timed one and `--verify`'s CPU replay), whose buffers are reused; a
        # state is known by its first buffer, which keeps its address (donated, updated in place).
        previous, compiled, constants = {}, {}, {}
        compile_step = plain_compile if args.plain_jit else compile_allocate_slots

        def step(state, computed):
            first = jax.tree.leaves(state)[0]
            lane, sharding = first.unsafe_buffer_pointer(), first.sharding
            reused = {"previous_output": previous.pop(lane)} if lane in previous else {}
            if sharding not in constants:
                constants[sharding] = jax.device_put((slots, ones), sharding)
            rows, new = constants[sharding]
            if (sharding, bool(reused)) not in compiled:
                compiled[sharding, bool(reused)] = compile_step(
                    config,
                    state,
                    rows,
                    computed,
                    new,
                    num_tokens=num_requests,
                    return_block_tables=return_block_tables,
                    **reused,
                )
            state, out = compiled[sharding, bool(reused)](state, rows, computed, new, **reused)
            if reuse_output:  # the caller reads `out` before the next step, which donates it
                previous[lane] = out
            return state, out

        return step

    @partial(jax.jit, donate_argnums=0)
    def fused(state, computed):  # append the sampled tokens and allocate, in one call
        tokens = jnp.zeros((num_requests, 1), jnp.int32).at[:, 0].set(computed % 256_000)
        state = append_token_ids(config, state, slots, tokens, ones)
        return allocate_slots(config, state, slots, computed, ones, num_tokens=num_requests)

    computed = lengths  # each step computes the token sampled by the previous one
    results = {}
    for name, step, sampler in [
        ("allocate_slots (persistent block tables, no copy)", allocate(False), sample),
        ("allocate_slots, previous output's buffers reused", allocate(False, reuse_output=True), sample),
        ("allocate_slots + block_tables [R, P] per group", allocate(True), sample),
        ("append token + allocate_slots + block_tables, one call", fused, lambda state, i: state),
    ]:
        state, computed, median, p10, failures = time_steps(
            step, state, computed, steps=args.steps, sample=sampler, verify=args.verify
        )
        results[name] = median
        print(f"  {name:<58} median {median:7.0f} us/step, p10 {p10:6.0f} us, failed rows {failures}")
        if args.only_persistent and len(results) == 2:
            break
    if args.mixed:
        median, p10, failures = time_mixed_steps(config, state, computed, steps=args.steps, sample=sample)
        name = f"allocate_slots, {num_requests - NEW_PER_STEP} decodes + {NEW_PER_STEP} new {NEW_PROMPT}-token prompts"
        print(f"  {name:<58} median {median:7.0f} us/step, p10 {p10:6.0f} us, failed rows {failures}")
    device = jax.devices()[0]
    best = min(results.values())
    print(
        f"allocator step: {num_requests} decode requests, 1 full + 5 SW-{WINDOW} groups, block {BLOCK}, contexts "
        f"{int(lengths.min())}-{int(computed.max())} tokens, on {device.platform} ({device.device_kind}, "
        f"{os.cpu_count()} CPUs visible, affinity {len(os.sched_getaffinity(0))}): {best:.0f} us/step median; "
        f"vLLM 0.33 Python KVCacheManager {VLLM_MS[0]}-{VLLM_MS[1]} ms: {1000 * VLLM_MS[0] / best:.1f}x faster"
    )
    print_memory_ratio()


def print_memory_ratio(context: int = 32768, max_num_batched_tokens: int = 2048):
    """Blocks one request holds at a 32,768-token context, over full-attention allocation in every layer group."""
    specs = gemma3_like_specs()
    full = len(specs) * math.ceil(context / BLOCK)
    for tokens in (1, max_num_batched_tokens):
        held = sum(
            s.max_num_blocks_per_request(max_model_len=context, max_num_batched_tokens=tokens) for s in specs
        )
        label = "decode (1 token/step)" if tokens == 1 else f"prefill chunks of {tokens} tokens"
        print(
            f"memory at {context} tokens, {label}: {held} blocks per request (1 full group {math.ceil(context / BLOCK)}"
            f" + 5 window groups), full attention everywhere {full}: ratio {held / full:.3f}"
        )
    in_window = AllocatorConfig(
        specs=specs,
        num_blocks=full + 1,
        max_num_seqs=1,
        max_model_len=context,
        max_num_batched_tokens=max_num_batched_tokens,
        sliding_window_in_window_only=True,
    )
    held = sum(in_window.admission_caps)
    print(
        f"memory at {context} tokens, sliding_window_in_window_only (chunks clipped to the window), any budget: "
        f"{held} blocks per request, ratio {held / full:.3f}"
    )


if __name__ == "__main__":
    main()
