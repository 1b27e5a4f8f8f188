"""Why a GPU allocator step re-records its CUDA graph: time the step with the per-step input at a new or the same
device address, and with ``--log`` print XLA's command-buffer update log for a few steps.

    PYTHONPATH=. python benchmarks/allocator_graph_updates.py [--steps 200]
    TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 PYTHONPATH=. \
        python benchmarks/allocator_graph_updates.py --log 3

Same setting as `allocator_step.py` (256 running decode requests, 1 full + 5 sliding-window groups).
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from allocator_step import running_decodes
from jax_hybrid_attn.allocator import allocate_slots, append_token_ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--reuse-output", action="store_true", help="pass the previous output (donated)")
    parser.add_argument(
        "--log", type=int, default=0, help="after warm-up, run this many logged steps and stop"
    )
    args = parser.parse_args()
    num_requests = args.requests
    config, state, computed = running_decodes(num_requests)
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    ones = jnp.ones(num_requests, jnp.int32)
    tokens = jnp.ones((num_requests, 1), jnp.int32)

    def run(state, computed, *, steps, fresh_input, timed):
        times, out = [], None
        for _ in range(steps):
            state = append_token_ids(config, state, slots, tokens, ones)
            jax.block_until_ready(state)
            if fresh_input:
                computed = computed + 1
                jax.block_until_ready(computed)
            start = time.perf_counter()
            state, out = allocate_slots(
                config,
                state,
                slots,
                computed,
                ones,
                num_tokens=num_requests,
                return_block_tables=False,
                previous_output=out if args.reuse_output else None,
            )
            jax.block_until_ready((state, out))
            times.append(time.perf_counter() - start)
            if not timed:
                print(f"---- step done: success {int(jnp.sum(out.success))}", file=sys.stderr, flush=True)
        return state, computed, 1e6 * float(np.median(times))

    state, computed, _ = run(state, computed, steps=20, fresh_input=True, timed=True)
    if args.log:
        print("---- warm-up done", file=sys.stderr, flush=True)
        run(state, computed, steps=args.log, fresh_input=True, timed=False)
        return
    for fresh_input in (True, False, True, False):
        state, computed, median = run(state, computed, steps=args.steps, fresh_input=fresh_input, timed=True)
        print(
            f"num_computed_tokens at a {'new' if fresh_input else 'fixed'} address: median {median:6.0f} us"
        )


if __name__ == "__main__":
    main()
