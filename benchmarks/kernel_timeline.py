"""Where the prefill kernel's warpgroups spend their time: Mosaic GPU's on-device profiler on one causal prefill.

Run from the repository root on the GPU machine:

    PYTHONPATH=. python benchmarks/kernel_timeline.py [--tokens 2048] [--variant ping_pong=0]

The kernel's phases are named scopes: in each consumer "wait K", "QK issue, turn", "QK wait", "softmax",
"wait V", "wait turn", "PV"; in the producer "wait K slot", "issue K", "wait V slot", "issue V". With
`KernelConfig.profile_dir` set, Mosaic GPU records when each range starts and ends on every warpgroup and
writes a Perfetto trace (open it in ui.perfetto.dev to see the timeline). This script sums each phase over
all CTAs, per role, and prints its share of that role's time from its first recorded event to its last. The
profiler adds a few cycles per range, so the shares, not the absolute times, are what it measures.
"""

import argparse
import collections
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn import make_attention_metadata, paged_attention
from kernel_variants import configs_changed, parse_variant

ROLES = ("consumer 0", "consumer 1", "producer")  # warpgroups of a two-consumer CTA, in order


def phase_shares(trace: dict, roles=ROLES) -> dict[str, dict[str, float]]:
    """{role: {phase: share of the role's recorded time}} from a Mosaic GPU profiler trace (Chrome trace JSON,
    "B"/"E" events; ``tid - 1`` counts warpgroups block by block)."""
    totals = collections.defaultdict(lambda: collections.defaultdict(float))
    spans = collections.defaultdict(float)
    events_by_thread = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        events_by_thread[event["tid"]].append(event)
    for tid, events in events_by_thread.items():
        role = roles[(tid - 1) % len(roles)]
        open_ranges = []
        for event in events:
            if event["ph"] == "B":
                open_ranges.append(event)
            else:
                begin = open_ranges.pop()
                totals[role][begin["name"]] += event["ts"] - begin["ts"]
        spans[role] += events[-1]["ts"] - events[0]["ts"]
    return {role: {name: t / spans[role] for name, t in sorted(phases.items())} for role, phases in totals.items()}


def profiled_prefill(num_tokens: int, profile_dir: str, **options) -> dict:
    """One causal prefill of `num_tokens` (32 query / 8 KV heads, head_dim 128, block 16, bf16) with the prefill
    kernel profiled; returns the trace it wrote."""
    with configs_changed(prefill=dict(profile_dir=profile_dir, **options)):
        block_size, num_blocks = 16, num_tokens // 16
        key_cache, key_q = jax.random.split(jax.random.key(0))
        kv_cache = jax.random.normal(key_cache, (num_blocks + 1, 2, block_size, 8, 128), jnp.bfloat16)
        tables = 1 + np.random.default_rng(0).permutation(num_blocks)[None]
        metadata = make_attention_metadata([num_tokens], [num_tokens], tables, block_size=block_size)
        q = jax.random.normal(key_q, (num_tokens, 32, 128), jnp.bfloat16)
        jax.block_until_ready(paged_attention(q, kv_cache, metadata))
        jax.effects_barrier()  # the profiler writes its trace from a host callback
    traces = sorted(glob.glob(os.path.join(profile_dir, "*-trace.json")))
    if not traces:
        raise RuntimeError(f"the profiler wrote no trace into {profile_dir}")
    with open(traces[-1]) as f:  # the prefill kernel's (profiled kernels only)
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="query tokens of the one request (multiple of 16)")
    parser.add_argument("--variant", action="append", help="comma-separated FIELD=INT settings of KernelConfig")
    args = parser.parse_args()
    for options in [{}] + [parse_variant(v) for v in args.variant or []]:
        with tempfile.TemporaryDirectory() as profile_dir:
            shares = phase_shares(profiled_prefill(args.tokens, profile_dir, **options))
        print(f"== {options or 'default'}: share of each warpgroup's time, summed over CTAs", flush=True)
        for role, phases in shares.items():
            listed = ", ".join(f"{name} {100 * share:.1f}%" for name, share in phases.items())
            print(f"{role}: {listed}; unnamed {100 * (1 - sum(phases.values())):.1f}%", flush=True)


if __name__ == "__main__":
    main()
