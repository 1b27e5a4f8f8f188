"""What admitting and finishing requests costs the engine's allocator: `KVCacheManager.add_request` and `free`
one request per device call, against `add_requests` and `free_requests` with the whole batch in one call (as
the scheduler now admits and frees them).

Run from the repository root:  PYTHONPATH=.:benchmarks python benchmarks/admission.py [--tiny]

The Gemma-3-1B shape of serving.py with the engine flags of startup.py's newcomer command (256 request slots,
``max_model_len`` 2,048); prompts of 128-1,023 random tokens. Prints, per batch size, the milliseconds until the
calls returned (host) and until the device finished them (done), each warm (a first round runs untimed).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from serving import GEMMA3_1B, TINY

from jax_hybrid_attn.engine import Engine, EngineConfig
from jax_hybrid_attn.models import ModelConfig, random_model

BATCHES = (1, 16, 64, 256)


def timed(fn, manager) -> tuple[float, float]:
    jax.block_until_ready(manager.state)
    started = time.perf_counter()
    fn()
    returned = time.perf_counter()
    jax.block_until_ready(manager.state)
    return returned - started, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    config = ModelConfig.from_hf(TINY if args.tiny else GEMMA3_1B)
    max_model_len = 256 if args.tiny else 2048
    engine = Engine(random_model(config, seed=0, dtype=jnp.bfloat16), config,
                    EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                                 max_model_len=max_model_len))  # fmt: skip
    manager = engine.manager
    manager.compile()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, size=n).tolist()
               for n in rng.integers(max_model_len // 16, max_model_len // 2, size=max(BATCHES))]  # fmt: skip
    rows = []
    for batch in BATCHES:
        ids, batch_prompts = [f"r{i}" for i in range(batch)], prompts[:batch]

        def add_each(ids=ids, batch_prompts=batch_prompts):
            for request_id, prompt in zip(ids, batch_prompts, strict=True):
                manager.add_request(request_id, prompt)

        def free_each(ids=ids):
            for request_id in ids:
                manager.free(request_id)

        for name, add, free in (
            ("one per call", add_each, free_each),
            ("one call", lambda ids=ids, p=batch_prompts: manager.add_requests(ids, p),
             lambda ids=ids: manager.free_requests(ids)),
        ):  # fmt: skip
            for _ in range(2):  # the second is timed
                add_s = timed(add, manager)
                free_s = timed(free, manager)
            rows.append(f"{batch} requests, {name}: add host {add_s[0] * 1e3:.1f} ms, done {add_s[1] * 1e3:.1f} ms; "
                        f"free host {free_s[0] * 1e3:.1f} ms, done {free_s[1] * 1e3:.1f} ms")  # fmt: skip
            print(rows[-1], flush=True)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
