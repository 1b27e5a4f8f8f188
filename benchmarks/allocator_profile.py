"""Profile the allocator step on the current device: kernels per step, device busy time, host syncs.

    PYTHONPATH=. python benchmarks/allocator_profile.py [--steps 5] [--hlo-out DIR]

Uses the setting of `allocator_step.py` (256 running decode requests, 1 full + 5 sliding-window groups). Prints,
per step, the device events by name (count and total µs), so that one can see what a GPU step is bound by; with
``--hlo-out`` it also writes the optimized HLO of the step.
"""

import argparse
import collections
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from allocator_step import running_decodes
from jax_hybrid_attn.allocator import allocate_slots, append_token_ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hlo-out", default=None)
    parser.add_argument("--top", type=int, default=25, help="events listed per line (0: all)")
    parser.add_argument(
        "--floor", action="store_true", help="also time what any jitted step over this state costs"
    )
    args = parser.parse_args()
    num_requests = args.requests
    config, state, computed = running_decodes(num_requests)
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    ones = jnp.ones(num_requests, jnp.int32)
    tokens = jnp.ones((num_requests, 1), jnp.int32)

    def step(state, computed):
        state = append_token_ids(config, state, slots, tokens, ones)
        jax.block_until_ready(state)
        return allocate_slots(
            config, state, slots, computed, ones, num_tokens=num_requests, return_block_tables=False
        )

    if args.floor:
        state = print_floor(state, computed, slots, ones)
    if args.hlo_out:
        os.makedirs(args.hlo_out, exist_ok=True)
        lowered = allocate_slots.lower(
            config, state, slots, computed, ones, num_tokens=num_requests, return_block_tables=False
        )
        with open(os.path.join(args.hlo_out, f"allocate_slots_{jax.default_backend()}.hlo"), "w") as f:
            f.write(lowered.compile().as_text())
    for _ in range(20):  # warm up: compile, then reach a steady state
        state, out = step(state, computed)
        computed = computed + 1
    jax.block_until_ready(out)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(args.steps):
            state, out = step(state, computed)
            jax.block_until_ready(out)
            computed = computed + 1
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = ProfileData.from_file(path)
    for plane in profile.planes:
        for line in plane.lines:
            events = [(e.name, e.duration_ns) for e in line.events]
            if not events:
                continue
            by_name = collections.defaultdict(lambda: [0, 0.0])
            for name, duration in events:
                by_name[name][0] += 1
                by_name[name][1] += duration / 1e3
            total = sum(d for _, d in events) / 1e3
            print(
                f"== {plane.name} / {line.name}: {len(events) / args.steps:.0f} events per step, "
                f"{total / args.steps:.0f} us per step"
            )
            top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top or None]
            for name, (count, micros) in top:
                print(f"   {count / args.steps:6.1f}x {micros / args.steps:8.1f} us  {name[:110]}")


def print_floor(state, computed, slots, ones, *, repeats: int = 200):
    """Median µs of calls that take the step's arguments and return a state of the same buffers: the dispatch
    floor of any jitted step over this state, without and with one data-dependent loop (a host sync on a GPU).
    Returns the state (the old one is donated)."""

    def touch(state, computed):  # one tiny write per call, so that the call is not empty
        leaves, tree = jax.tree.flatten(state)
        leaves[0] = leaves[0].at[0].add(jnp.sum(computed[:1] * 0).astype(leaves[0].dtype))
        return jax.tree.unflatten(tree, leaves), computed + slots * 0 + ones * 0

    def with_loop(state, computed):
        state, computed = touch(state, computed)
        skip = jax.lax.while_loop(
            lambda c: c[0] < jnp.min(computed) - 1_000_000, lambda c: (c[0] + 1,), (0,)
        )[0]
        return state, computed + skip

    for name, fn in (("jitted call, state donated", touch), ("+ one data-dependent loop", with_loop)):
        call = jax.jit(fn, donate_argnums=0)
        times = []
        for i in range(repeats + 10):
            start = time.perf_counter()
            state, out = call(state, computed)
            jax.block_until_ready((state, out))
            if i >= 10:
                times.append(time.perf_counter() - start)
        print(f"floor: {name:<32} median {1e6 * float(np.median(times)):6.0f} us")
    return state


if __name__ == "__main__":
    main()
