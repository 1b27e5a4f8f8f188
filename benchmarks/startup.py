"""Startup: what a new user waits for, from `jha generate` to its last token, beside transformers' `generate_batch`.

Run from the repository root:  PYTHONPATH=. python benchmarks/startup.py [--sections processes,depth] [--tiny]

  processes  a Gemma-3-1B-shaped checkpoint written by transformers' `save_pretrained` (random bf16 weights, 26
             layers) and 256 text prompts of 128-1,023 bytes, 64 greedy tokens each, EOS off. Each run is a new
             process, timed whole: `jha generate` with the tuned flags cold (an empty compilation cache), again
             with the cache filled, with the CLI's defaults (cache filled), and cold with `--cascade-attention
             off` (what the default's cascade decode shape costs a new process) and cold with
             `--no-cublas-matmuls` (XLA's Triton GEMMs); then transformers' `generate_batch` (`paged|sdpa`) on the
             same token ids. Ours split their wall time into import, weight loading, engine setup, compiling (of it
             lowering), serving, and the first token's time since the process started;
  kernels    in this process: every step shape lowered (the engine's executables, abstract weights), the Mosaic GPU
             kernels each one holds (distinct modules: jaxlib compiles each once per process, one at a time, under
             one lock), each kernel's compile on its own (`MosaicGpuCompile`), then each shape's XLA compile;
  xla-flags  cold runs of the newcomer command (no cache) under XLA_FLAGS variants: compile time against speed;
  depth      in this process: the compile time of one step shape (the 8,192-token mixed shape and the decode
             shape) for 6 and for 26 layers of the same shape, the layers scanned (the engine's forward) and
             unrolled (`Decoder.__call__`, as the engine ran before), each forward's run time on empty rows (every
             matmul of the step, no attention work), and the kernels' share of a compile (the same forward on the
             jnp reference attention).

Prints one line per measurement and a table last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # transformers shares the GPU in `processes`

import numpy as np
from serving import GEMMA3_1B, TINY

NEWCOMER_FLAGS = ["--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--max-model-len", "2048"]
NUM_PROMPTS, MAX_TOKENS = 256, 64


def write_checkpoint(directory: str, shape: dict) -> None:
    """A Gemma-3-shaped transformers checkpoint with random bf16 weights (seeded), no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    transformers.Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def write_prompts(path: str, *, num_prompts: int, lengths: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    words = ["attention", "window", "sliding", "block", "cache", "token", "layer", "model", "serve", "batch"]
    with open(path, "w") as f:
        for n in rng.integers(*lengths, num_prompts):
            text = ""
            while len(text) < n:
                text += words[rng.integers(len(words))] + " "
            f.write(text[:n].strip() + "\n")


def run_process(args: list[str], env: dict | None = None) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall, done.stdout


def ours(label: str, model_dir: str, prompts: str, flags: list[str], rows: list, *, env: dict | None = None,
         section: str = "processes") -> dict:
    command = [sys.executable, "-m", "jax_hybrid_attn", "generate", "--model", model_dir, "--prompt-file", prompts,
               "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", "--no-progress", *flags]  # fmt: skip
    wall, stdout = run_process(command, env)
    payload = json.loads(stdout)
    m = payload["metrics"]
    split = ", ".join(f"{k} {v:.1f}" for k, v in m["startup_s"].items())
    line = (f"{label} | process {wall:.1f} s | {split} | serving {m['wall_s']:.1f} s | first token at "
            f"{m['first_token_since_start_s']:.1f} s | prefill {m['prefill_tokens_per_s'] or 0:,.0f} tok/s, "
            f"decode {m['decode_tokens_per_s'] or 0:,.0f} tok/s | shapes {', '.join(m['step_shapes'])}")  # fmt: skip
    print(section, line, flush=True)
    rows.append((section, line))
    timeline = "; ".join(f"{name} {t['lowered_at_s']:.1f} -> {t['compiled_at_s']:.1f}"
                         for name, t in m["compile_timeline"].items())  # fmt: skip
    print(section, f"{label} | compile timeline (s from its start: lowered -> compiled) | {timeline}", flush=True)
    return {"wall": wall, "payload": payload}


TRANSFORMERS_CHILD = """
import json, sys, time
started = time.perf_counter()
import torch, transformers
model_dir, ids_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.load(open(ids_path))
model = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
model.set_attn_implementation("paged|sdpa")
loaded = time.perf_counter()
generation = transformers.GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
needed = sum(len(p) + max_tokens for p in prompts)
batching = transformers.ContinuousBatchingConfig(num_blocks=needed // 256 + len(prompts) + 16, max_batch_tokens=8192,
                                                 use_cuda_graph=False, use_async_batching=False)
out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
torch.cuda.synchronize()
tokens = [list(out[k].generated_tokens) for k in sorted(out, key=lambda k: int(str(k).split("_")[-1]))]
print(json.dumps({"load_s": loaded - started, "generate_s": time.perf_counter() - loaded, "tokens": tokens}))
"""


def transformers_process(model_dir: str, token_ids: list[list[int]], rows: list) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(token_ids, f)
    wall, stdout = run_process([sys.executable, "-c", TRANSFORMERS_CHILD, model_dir, f.name, str(MAX_TOKENS)])
    payload = json.loads(stdout)
    line = (f"transformers generate_batch paged|sdpa | process {wall:.1f} s | load {payload['load_s']:.1f} s | "
            f"generate {payload['generate_s']:.1f} s")  # fmt: skip
    print("processes", line, flush=True)
    rows.append(("processes", line))
    return {"wall": wall, "payload": payload}


def processes(rows: list, *, shape: dict, transformers_too: bool, num_prompts: int, lengths) -> None:
    with tempfile.TemporaryDirectory() as work:
        model_dir, prompts, cache = (os.path.join(work, name) for name in ("model", "prompts.txt", "cache"))
        write_checkpoint(model_dir, shape)
        write_prompts(prompts, num_prompts=num_prompts, lengths=lengths)
        runs = {
            "cold": ours("ours, cold (empty cache)", model_dir, prompts, [*NEWCOMER_FLAGS, "--compilation-cache", cache], rows),
            "cached": ours("ours, second process (cache filled)", model_dir, prompts,
                           [*NEWCOMER_FLAGS, "--compilation-cache", cache], rows),  # fmt: skip
            "defaults": ours("ours, the CLI's defaults (cache filled)", model_dir, prompts,
                             ["--compilation-cache", cache], rows),  # fmt: skip
            # what the cascade decode shape (compiled by default, `--cascade-attention auto`) costs a new process
            "cold, cascade off": ours("ours, cold (empty cache), --cascade-attention off", model_dir, prompts,
                                      [*NEWCOMER_FLAGS, "--cascade-attention", "off", "--compilation-cache",
                                       os.path.join(work, "cache-off")], rows),
        }  # fmt: skip
        # the matmuls on XLA's Triton GEMMs (`--no-cublas-matmuls`: each scanned layer's weights copied out first)
        triton = ours("ours, cold (empty cache), --no-cublas-matmuls", model_dir, prompts,
                      [*NEWCOMER_FLAGS, "--no-cublas-matmuls", "--compilation-cache",
                       os.path.join(work, "cache-triton")], rows)  # fmt: skip
        outputs = runs["cold"]["payload"]["outputs"]
        same = all(r["payload"]["outputs"] == outputs for r in runs.values())
        agree = np.mean([a == b for x, y in zip(outputs, triton["payload"]["outputs"])
                         for a, b in zip(x["output_token_ids"], y["output_token_ids"])])  # fmt: skip
        line = (f"all {len(runs)} cuBLAS runs' greedy tokens equal: {same}; the Triton GEMMs' equal to theirs: "
                f"{agree:.1%} (bf16 sums in another order)")
        print("processes", line, flush=True)
        rows.append(("processes", line))
        if transformers_too:
            ids = [o["prompt_token_ids"] for o in outputs]
            hf = transformers_process(model_dir, ids, rows)
            ours_tokens = [o["output_token_ids"] for o in outputs]
            agree = np.mean([a == b for x, y in zip(ours_tokens, hf["payload"]["tokens"]) for a, b in zip(x, y)])
            line = f"greedy tokens equal to transformers': {agree:.1%} (bf16, random weights: near ties decide)"
            print("processes", line, flush=True)
            rows.append(("processes", line))


def depth(rows: list, *, shape: dict, depths=(6, 26), repeats: int = 20) -> None:
    """Compile and run time of the forward at two depths, scanned against unrolled, kernels against reference."""
    import jax
    import jax.numpy as jnp

    from jax_hybrid_attn.engine import EngineConfig
    from jax_hybrid_attn.engine.device_step import forward
    from jax_hybrid_attn.engine.model_runner import ModelRunner
    from jax_hybrid_attn.models import ModelConfig, random_model

    for layers in depths:
        hf = dict(shape, num_hidden_layers=layers, layer_types=shape["layer_types"][:layers])
        config = ModelConfig.from_hf(hf)
        model = random_model(config, seed=0, dtype=jnp.bfloat16)
        engine_config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
        engine_config = engine_config.resolved(platform=jax.default_backend())
        for variant in ("scanned", "unrolled", "scanned, reference attention"):
            options = {"implementation": "reference"} if "reference" in variant else {}
            runner = ModelRunner(model, config, EngineConfig(**{**engine_config.__dict__, **options}),
                                 max_model_len=2048)  # fmt: skip
            weights = runner.model if variant != "unrolled" else _Unrolled.of(model)
            fn = jax.jit(partial(forward, runner.layout, runner.allocator_config, runner.config.implementation,
                                 runner.config.interpret), static_argnames=("num_tokens", "max_query_len"),
                         donate_argnames=("kv_cache",))  # fmt: skip
            inputs = runner._abstract_inputs()
            out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), inputs["out"])
            for shape_ in (runner.shapes[0], runner.shapes[-1]):
                t = time.perf_counter()
                lowered = fn.lower(weights, inputs["kv_cache"], inputs["out"], num_tokens=shape_.num_tokens,
                                   max_query_len=shape_.max_query_len)  # fmt: skip
                lowering = time.perf_counter() - t
                t = time.perf_counter()
                compiled = lowered.compile()
                compiling = time.perf_counter() - t
                kv = runner.kv_cache
                kv, _ = compiled(weights, kv, out)  # warm
                jax.block_until_ready(kv)
                t = time.perf_counter()
                for _ in range(repeats):
                    kv, logits = compiled(weights, kv, out)
                jax.block_until_ready(logits)
                run_ms = (time.perf_counter() - t) / repeats * 1e3
                runner.kv_cache = kv
                line = (f"{layers} layers, {variant}, shape {shape_} | lowering {lowering:.2f} s | XLA compile "
                        f"{compiling:.2f} s | run {run_ms:.3f} ms per call (empty rows)")  # fmt: skip
                print("depth", line, flush=True)
                rows.append(("depth", line))
            del runner


def kernels(rows: list, *, shape: dict) -> None:
    """Lowering of every step shape, its distinct Mosaic GPU kernels and their compile times, then XLA's."""
    import ctypes

    import jax
    from jax.experimental.mosaic.gpu import core as mosaic_core

    from jax_hybrid_attn.engine import EngineConfig
    from jax_hybrid_attn.engine.step_cache import RunnerSpec
    from jax_hybrid_attn.models import ModelConfig

    config = ModelConfig.from_hf(shape)
    engine_config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    engine_config = engine_config.resolved(platform=jax.default_backend())
    runner = RunnerSpec(config, engine_config, 2048, "bfloat16", "bfloat16").abstract_runner()

    def record(line):
        print("kernels", line, flush=True)
        rows.append(("kernels", line))

    lowered, kernels_of = {}, {}
    for key in runner.executable_keys():
        before = set(mosaic_core.KNOWN_KERNELS)
        t = time.perf_counter()
        lowered[key] = runner.trace(key).lower()
        lowering = time.perf_counter() - t
        kernels_of[key] = [k for k in mosaic_core.KNOWN_KERNELS if k not in before]
        record(f"{key[0]} {key[1]} | lowering {lowering:.2f} s | new kernels {len(kernels_of[key])}")
    record(f"distinct Mosaic GPU kernels in all shapes: {len(mosaic_core.KNOWN_KERNELS)}")

    compile_s = {}
    if jax.default_backend() == "gpu":
        import jax_plugins.xla_cuda13 as cuda_plugin

        cuda = ctypes.CDLL("libcuda.so.1")
        context, device = ctypes.c_void_p(), ctypes.c_int()
        assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        assert cuda.cuCtxSetCurrent(context) == 0
        plugin = ctypes.CDLL(cuda_plugin._get_library_path())
        plugin.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
        plugin.MosaicGpuCompile.restype = ctypes.POINTER(ctypes.c_void_p)
        for kernel_id, module in mosaic_core.KNOWN_KERNELS.items():
            t = time.perf_counter()
            assert plugin.MosaicGpuCompile(module, len(module)), "Mosaic GPU compile failed"
            compile_s[kernel_id] = time.perf_counter() - t
        total = sum(compile_s.values())
        record(f"Mosaic GPU kernel compiles, one at a time: {total:.1f} s in all, "
               f"{min(compile_s.values()):.2f}-{max(compile_s.values()):.2f} s each")  # fmt: skip
    for key, step in lowered.items():
        t = time.perf_counter()
        step.compile()
        whole = time.perf_counter() - t
        own = sum(compile_s.get(k, 0.0) for k in kernels_of[key])
        record(f"{key[0]} {key[1]} | compile {whole:.2f} s, of it its new kernels ~{own:.2f} s")


XLA_FLAG_VARIANTS = {
    "default": "",
    "autotune level 0": "--xla_gpu_autotune_level=0",
    "no Triton GEMMs": "--xla_gpu_enable_triton_gemm=false",
}


def xla_flags(rows: list, *, shape: dict, num_prompts: int, lengths) -> None:
    """The newcomer command cold (no cache) under each of `XLA_FLAG_VARIANTS`."""
    with tempfile.TemporaryDirectory() as work:
        model_dir, prompts = os.path.join(work, "model"), os.path.join(work, "prompts.txt")
        write_checkpoint(model_dir, shape)
        write_prompts(prompts, num_prompts=num_prompts, lengths=lengths)
        for label, flags in XLA_FLAG_VARIANTS.items():
            env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
            ours(f"ours, cold, XLA flags {label}", model_dir, prompts, NEWCOMER_FLAGS, rows, env=env,
                 section="xla-flags")  # fmt: skip


class _Unrolled:
    """`Decoder.__call__` as a pytree argument (graph static, weights data): the layers one after another."""

    def __init__(self, graph, state):
        self.graph, self.state = graph, state

    @classmethod
    def of(cls, model):
        from flax import nnx

        return cls(*nnx.split(model))

    def __call__(self, token_ids, cache, *, logits_indices=None):
        from flax import nnx

        return nnx.merge(self.graph, self.state)(token_ids, cache, logits_indices=logits_indices)


def _register_unrolled():
    import jax

    jax.tree_util.register_pytree_node(
        _Unrolled, lambda u: ((u.state,), u.graph), lambda graph, children: _Unrolled(graph, children[0])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="processes,depth")
    parser.add_argument("--tiny", action="store_true", help="a dry run on a small model (CPU)")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    _register_unrolled()
    shape = TINY if args.tiny else GEMMA3_1B
    sections = args.sections.split(",")
    rows: list = []
    if "processes" in sections:
        processes(rows, shape=shape, transformers_too=not args.no_transformers,
                  num_prompts=8 if args.tiny else NUM_PROMPTS, lengths=(16, 64) if args.tiny else (128, 1024))  # fmt: skip
    if "kernels" in sections:
        kernels(rows, shape=shape)
    if "xla-flags" in sections:
        xla_flags(rows, shape=shape, num_prompts=8 if args.tiny else NUM_PROMPTS,
                  lengths=(16, 64) if args.tiny else (128, 1024))  # fmt: skip
    if "depth" in sections:
        tiny_depth = dict(TINY, num_hidden_layers=26, layer_types=GEMMA3_1B["layer_types"])
        depth(rows, shape=tiny_depth if args.tiny else shape, repeats=2 if args.tiny else 20)
    print("\n| section | measurement |\n|---|---|")
    for section, line in rows:
        print(f"| {section} | {line} |")


if __name__ == "__main__":
    main()
