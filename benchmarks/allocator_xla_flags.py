"""Time the allocator step on the GPU under several XLA flag sets, each in its own process (flags are read once).

    PYTHONPATH=. python benchmarks/allocator_xla_flags.py [--steps 100] [--verify] [--variants NAME ...]

The step is a few hundred small operations with data-dependent loops, so on a GPU it is bound by kernel launches
and by the host syncs of loop conditions. XLA's command buffers (CUDA graphs; with WHILE and CONDITIONAL, loops
and conditionals become conditional graph nodes, with no host sync) may remove both. ``--verify`` replays every
timed step on the CPU and requires bit-identical outputs and state (an earlier version of the step gave wrong
results under WHILE/CONDITIONAL command buffers). Also timed: the same step on this machine's CPU, compiled by
`compile_allocate_slots` (one task per operation) and as plain `jax.jit` compiles it.
"""

import argparse
import os
import re
import subprocess
import sys

COMMAND_BUFFER_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
VARIANTS = {
    "gpu-default": {},
    "gpu-while-cond-graphs": {
        "XLA_FLAGS": f"--xla_gpu_enable_command_buffer={COMMAND_BUFFER_ALL} --xla_gpu_graph_min_graph_size=1"
    },
    "gpu-no-graphs": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    # One temp buffer per executable, kept between calls: graph nodes that use only temps need no update.
    "gpu-skip-temp": {"XLA_FLAGS": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"},
    "cpu-all-cores": {"JAX_PLATFORMS": "cpu"},
    "cpu-2-cores": {"JAX_PLATFORMS": "cpu", "PIN_CORES": "0,1"},
    # compiled as plain `jax.jit` does: XLA splits the big gathers and scatters over 2 tasks
    "cpu-2-cores-plain-jit": {"JAX_PLATFORMS": "cpu", "PIN_CORES": "0,1", "ARGS": "--plain-jit"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    script = os.path.join(os.path.dirname(__file__), "allocator_step.py")
    rows = []
    for name in args.variants:
        env = dict(VARIANTS[name])
        command = [
            sys.executable,
            script,
            "--steps",
            str(args.steps),
            "--only-persistent",
            *env.pop("ARGS", "").split(),
        ]
        if args.verify and not env.get("JAX_PLATFORMS"):
            command.append("--verify")
        if "PIN_CORES" in env:
            command = ["taskset", "-c", env.pop("PIN_CORES"), *command]
        result = subprocess.run(
            command, check=False, env={**os.environ, **env}, capture_output=True, text=True
        )
        found = re.search(r"median\s+(\d+) us/step", result.stdout)
        median = found.group(1) if found else f"failed: {result.stderr.strip().splitlines()[-1:]}"
        print(f"--- {name}\n{result.stdout}", flush=True)
        rows.append((name, median, "--verify" in command and found is not None))
    print("| variant | allocate-only step, median us | bit-identical to the CPU |\n|---|---|---|")
    for name, median, verified in rows:
        print(f"| {name} | {median} | {'yes' if verified else '-'} |")


if __name__ == "__main__":
    main()
