"""What ptxas reports for the prefill kernel (registers, spills, serialized wgmma), default against variants.

Run from the repository root on the GPU machine:

    PYTHONPATH=. python benchmarks/kernel_resources.py [--variant ping_pong=0 --variant consumer_registers=224,producer_registers=56]

Mosaic GPU prints ptxas's verbose output when ``MOSAIC_GPU_DUMP_PTXAS`` is set; this script sets it, compiles one
small causal prefill per configuration (32 query / 8 KV heads, head_dim 128, block 16, bf16) and prints the lines
about registers, spills and wgmma serialization. A variant sets integer fields of the prefill's `KernelConfig`.
"""

import argparse
import contextlib
import os
import re
import sys
import tempfile

os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # before jax: Mosaic GPU reads it when it compiles

import jax
import jax.numpy as jnp

from jax_hybrid_attn import paged_attention
from jax_hybrid_attn.testing import random_paged_inputs
from kernel_variants import configs_changed, parse_variant

INTERESTING = re.compile(r"registers|spill|serializ|warning|entry function", re.IGNORECASE)
DEFAULT_VARIANTS = ("ping_pong=0", "consumer_registers=224,producer_registers=56")


def compile_prefill(**options) -> None:
    with configs_changed(decode=options, prefill=options):
        inputs = random_paged_inputs(0, query_lens=[300], seq_lens=[300], num_q_heads=32, num_kv_heads=8,
                                     head_dim=128, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
        jax.block_until_ready(paged_attention(inputs.q, inputs.kv_cache, inputs.metadata))


@contextlib.contextmanager
def captured_fds():
    """What the process writes to its stdout and stderr file descriptors (ptxas writes there, not to Python's
    streams), as the text of the yielded list's one element once the block ends."""
    text = []
    with tempfile.TemporaryFile(mode="w+") as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text.append(sink.read())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant", action="append", help="comma-separated FIELD=INT settings of KernelConfig (repeatable)"
    )
    args = parser.parse_args()
    for options in [{}] + [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]:
        print(f"== {options or 'default'}", flush=True)
        with captured_fds() as output:
            compile_prefill(**options)
        lines = [line for line in output[0].splitlines() if INTERESTING.search(line)]
        print("\n".join(lines) or "(ptxas reported nothing of interest)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
