"""Prefill steps that defer what they cannot serve at once, against prefill steps that serve every row.

Run from the repository root on a GPU:

  PYTHONPATH=.:benchmarks python benchmarks/deferred_prefill.py [--rounds 3]

The engine sends a step that admits no request that may hit the prefix cache as a deferring step
(`Scheduler.lookups_may_hit`): its allocation has no loop or branch on device values, so the host sends the next
step while the GPU computes this one. The other rule serves every row of a prefill step at once, through the
allocator's loop over rows, whose conditions make the host wait for the step in flight (the engine's rule before
prefill steps deferred). The throughput workload of `serving.py` (the Gemma-3-1B shape with random bf16 weights,
256 prompts of 128–1,024 random tokens, 64 greedy tokens each) runs warm under each rule in turn, in one process;
prints the whole job's wall time, prefill and decode tok/s, and whether both rules give the same tokens.
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np

from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams
from jax_hybrid_attn.engine.scheduler import Scheduler
from jax_hybrid_attn.models import ModelConfig, random_model
from serving import GEMMA3_1B

RULES = {
    "deferring prefill steps": Scheduler.lookups_may_hit,
    "prefill steps serve every row": lambda self, rows: any(work.num_tokens > 1 for _, work in rows),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = ModelConfig.from_hf(GEMMA3_1B)
    model = random_model(config, seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, int(n)).tolist() for n in rng.integers(128, 1025, 256)]
    sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = Engine(model, config, EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                                                max_model_len=2048))  # fmt: skip
    engine.generate(prompts, sampling)  # compiles
    tokens, rows = {}, []
    for _ in range(args.rounds):
        for name, rule in RULES.items():
            Scheduler.lookups_may_hit = rule
            engine.reset()
            started = time.perf_counter()
            outputs = engine.generate(prompts, sampling)
            wall = time.perf_counter() - started
            tokens.setdefault(name, [o.output_token_ids for o in outputs])
            s = engine.stats
            rows.append(f"| {name} | {wall:.3f} s | {s.prefill_tokens_per_s:,.0f} | {s.decode_tokens_per_s:,.0f} | "
                        f"{s.steps} | {s.deferred_rows} |")  # fmt: skip
            print(rows[-1], flush=True)
    Scheduler.lookups_may_hit = RULES["deferring prefill steps"]
    first, second = tokens.values()
    print(f"greedy tokens equal under both rules: {first == second}")
    print("| rule | warm wall | prefill tok/s | decode tok/s | steps | deferred rows |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
