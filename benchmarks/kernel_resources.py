"""What ptxas reports for a kernel (registers, spills, serialized wgmma), default against variants.

Run from the repository root, on the GPU machine or, with the CUDA plugin, on a CPU (compiled for an H200 without
one, as `kernel_census.py` does):

    PYTHONPATH=.:benchmarks python benchmarks/kernel_resources.py [--kernel prefill|narrow-decode]
        [--variant ping_pong=0 --variant consumer_registers=224,producer_registers=56]

Mosaic GPU prints ptxas's verbose output when ``MOSAIC_GPU_DUMP_PTXAS`` is set; this script sets it, compiles one
small call per configuration and prints the lines about registers, spills and wgmma serialization: the prefill
kernel on a causal prefill (32 query / 8 KV heads, head_dim 128, block 16, bf16), or the narrow decode kernel on
decodes over a float8 "HND_VT" cache (the same heads, blocks of 64, window 1,024). A variant sets integer fields of
both kernels' `KernelConfig`.
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

from jax import export
from jax.sharding import SingleDeviceSharding

from jax_hybrid_attn import CAUSAL, LayerAttentionParams, paged_attention
from jax_hybrid_attn.testing import random_paged_inputs
from kernel_census import compile_target
from kernel_variants import configs_changed, parse_variant

INTERESTING = re.compile(r"registers|spill|serializ|warning|entry function", re.IGNORECASE)
DEFAULT_VARIANTS = ("ping_pong=0", "consumer_registers=224,producer_registers=56")


def compile_call(kernel: str, **options) -> None:
    """Compile (on a GPU: run) `kernel`'s small call with these `KernelConfig` options on both kernels."""
    if kernel == "prefill":
        inputs = random_paged_inputs(0, query_lens=[300], seq_lens=[300], num_q_heads=32, num_kv_heads=8,
                                     head_dim=128, block_size=16, dtype=jnp.bfloat16)  # fmt: skip
        params = CAUSAL
    else:
        inputs = random_paged_inputs(0, query_lens=[1] * 4, seq_lens=[3000] * 4, num_q_heads=32, num_kv_heads=8,
                                     head_dim=128, block_size=64, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn,
                                     kv_layout="HND_VT")  # fmt: skip
        params = LayerAttentionParams(sliding_window=1024)
    args = (inputs.q, inputs.kv_cache, inputs.metadata)
    with configs_changed(decode=options, prefill=options):
        call = jax.jit(lambda q, c, m: paged_attention(q, c, m, params=params, implementation="kernel"))
        if jax.default_backend() == "gpu":
            jax.block_until_ready(call(*args))
            return
        exported = export.export(call, platforms=["cuda"])(*args)
    sharding = SingleDeviceSharding(compile_target()[0])
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in exported.in_avals]
    jax.jit(exported.call).trace(*jax.tree.unflatten(exported.in_tree, abstract)[0]).lower().compile()


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
    parser.add_argument("--kernel", choices=("prefill", "narrow-decode"), default="prefill")
    parser.add_argument(
        "--variant", action="append", help="comma-separated FIELD=INT settings of KernelConfig (repeatable)"
    )
    args = parser.parse_args()
    variants = args.variant or (DEFAULT_VARIANTS if args.kernel == "prefill" else ())
    for options in [{}] + [parse_variant(v) for v in variants]:
        print(f"== {args.kernel} {options or 'default'}", flush=True)
        with captured_fds() as output:
            compile_call(args.kernel, **options)
        lines = [line for line in output[0].splitlines() if INTERESTING.search(line)]
        print("\n".join(lines) or "(ptxas reported nothing of interest)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
