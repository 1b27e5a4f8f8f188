"""Time the allocator step on the GPU under several XLA flag sets, each in its own process (flags are read once).

    PYTHONPATH=. python benchmarks/allocator_xla_flags.py [--steps 100]

The step is a few hundred small operations with data-dependent loops, so on a GPU it is bound by kernel launches
and by the host syncs of loop conditions; XLA's command buffers (CUDA graphs, with conditional nodes for `while`
and `conditional`) would remove both, but with WHILE and CONDITIONAL command buffers (XLA in jax 0.11.2) the step
returned wrong results on the H200, so that variant is not offered. Also timed: the same step on this machine's CPU.
"""

import argparse
import os
import re
import subprocess
import sys

VARIANTS = {
    "gpu, default flags": {},
    "gpu, command buffers off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "cpu, all cores": {"JAX_PLATFORMS": "cpu"},
    "gpu, command buffers of 20+ operations only": {"XLA_FLAGS": "--xla_gpu_graph_min_graph_size=20"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    script = os.path.join(os.path.dirname(__file__), "allocator_step.py")
    rows = []
    for name, env in VARIANTS.items():
        result = subprocess.run(
            [sys.executable, script, "--steps", str(args.steps), "--only-persistent"],
            check=False,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        found = re.search(r"median\s+(\d+) us/step", result.stdout)
        median = found.group(1) if found else f"failed: {result.stderr.strip().splitlines()[-1:]}"
        print(f"--- {name}\n{result.stdout}", flush=True)
        rows.append((name, median))
    print("| variant | allocate-only step, median us |\n|---|---|")
    for name, median in rows:
        print(f"| {name} | {median} |")


if __name__ == "__main__":
    main()
