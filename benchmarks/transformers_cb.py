"""transformers' continuous batching: ``paged|jax_hybrid`` (this package, over transformers' own cache tensors)
beside ``paged|sdpa``, same model, prompts and settings, in one process.

Run from the repository root (the interop package importable as jax_hybrid_attn_torch, e.g. installed, or a
link to interop/ on PYTHONPATH):

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python benchmarks/transformers_cb.py [--tiny]

Workloads, on a Gemma-3-1B-shaped model with random bf16 weights (greedy, EOS off):
  mixed  256 prompts of 128-1,024 random tokens, 64 new tokens each;
  long   16 prompts of 8,192 random tokens, 16 new tokens each.
Each runs a first time before it is timed: paged|jax_hybrid the whole workload (it compiles its step shapes),
paged|sdpa its first few prompts (torch loads its kernels). The share of
wall time spent on the host inside paged|jax_hybrid's calls (planning, copies into buckets, DLPack, dispatch) is
measured around the registered function.
"""

import argparse
import contextlib
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import jax
import numpy as np
import torch
import transformers
from serving import GEMMA3_1B, TINY

from jax_hybrid_attn_torch import transformers_cb

WORKLOADS = {"mixed": dict(num_prompts=256, lengths=(128, 1025), new_tokens=64),
             "long": dict(num_prompts=16, lengths=(8192, 8193), new_tokens=16)}  # fmt: skip

SDPA_WARMUP_PROMPTS = 4
MIN_NUM_BLOCKS = 1024  # transformers shares the blocks among its layer groups: a few long prompts need this many


def prompts_of(workload: dict, vocab_size: int, *, tiny: bool) -> list[list[int]]:
    rng = np.random.default_rng(0)
    num, (low, high) = workload["num_prompts"], workload["lengths"]
    if tiny:
        num, low, high = 6, max(8, low // 64), max(9, high // 64, low // 64 + 1)
    return [rng.integers(1, vocab_size, int(n)).tolist() for n in rng.integers(low, high, num)]


def run(model, prompts, new_tokens: int, implementation: str, *, block_size: int) -> tuple[list, float]:
    model.set_attn_implementation(implementation)
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)  # fmt: skip
    needed = sum(len(p) + new_tokens for p in prompts)
    batching = transformers.ContinuousBatchingConfig(
        block_size=block_size, num_blocks=max(needed // block_size + 2 * len(prompts) + 16, MIN_NUM_BLOCKS), max_batch_tokens=8192,
        use_cuda_graph=False, use_async_batching=False,
    )  # fmt: skip
    started = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    ordered = sorted(out.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    return [list(o.generated_tokens) for o in ordered], seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and few short prompts (a CPU dry run)")
    parser.add_argument("--workloads", default="mixed,long")
    parser.add_argument("--num-prompts", type=int, help="prompts per workload (default: the workload's own)")
    parser.add_argument("--trace", metavar="DIR", help="profile the second paged|jax_hybrid run into DIR (CUPTI)")
    args = parser.parse_args()
    shape = TINY if args.tiny else GEMMA3_1B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    model = transformers.Gemma3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    name = transformers_cb.register()
    registered = transformers.AttentionInterface._global_mapping[name]
    host = {"seconds": 0.0, "calls": 0}

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return registered(*args, **kwargs)
        finally:
            host["seconds"] += time.perf_counter() - started
            host["calls"] += 1

    transformers.AttentionInterface._global_mapping[name] = timed
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}", flush=True)
    rows = []
    block_size = 16 if args.tiny else 256
    for workload_name in args.workloads.split(","):
        workload = WORKLOADS[workload_name]
        if args.num_prompts:
            workload = dict(workload, num_prompts=args.num_prompts)
        prompts = prompts_of(workload, config.vocab_size, tiny=args.tiny)
        prompt_tokens = sum(map(len, prompts))
        results = {}
        for implementation in ("paged|sdpa", name):
            # a first run: ours compiles its step shapes; torch loads its kernels (a few prompts do)
            warm_prompts = prompts if implementation == name else prompts[:SDPA_WARMUP_PROMPTS]
            _, cold = run(model, warm_prompts, workload["new_tokens"], implementation, block_size=block_size)
            print(f"{workload_name} | {implementation} | first run, {len(warm_prompts)} prompts {cold:.2f} s", flush=True)
            host.update(seconds=0.0, calls=0)
            profile = args.trace and implementation == name
            with jax.profiler.trace(f"{args.trace}/{workload_name}") if profile else contextlib.nullcontext():
                results[implementation] = run(model, prompts, workload["new_tokens"], implementation,
                                              block_size=block_size)  # fmt: skip
            print(f"{workload_name} | {implementation} | {results[implementation][1]:.2f} s", flush=True)
        base_tokens, base_seconds = results["paged|sdpa"]
        for implementation, (tokens, seconds) in results.items():
            output = sum(map(len, tokens))
            same = np.mean([a == b for x, y in zip(tokens, base_tokens) for a, b in zip(x, y)])
            extra = ""
            if implementation == name:
                extra = (f" | host time in our calls {host['seconds']:.2f} s ({host['seconds'] / seconds:.0%} of wall, "
                         f"{host['seconds'] / max(host['calls'], 1) * 1e6:.0f} us per layer call)")  # fmt: skip
            line = (f"{workload_name} | {implementation} | {len(prompts)} prompts, {prompt_tokens:,} prompt tokens | "
                    f"{seconds:.2f} s | total {(prompt_tokens + output) / seconds:,.0f} tok/s | "
                    f"{base_seconds / seconds:.2f}x paged|sdpa | greedy tokens equal to paged|sdpa's {same:.0%}{extra}")  # fmt: skip
            print(line, flush=True)
            rows.append(line)
    print("\n== summary ==")
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
