"""`jha generate` (also ``python -m jax_hybrid_attn generate``): serve prompts with the engine and report.

    jha generate --prompt "Hello" --max-tokens 32                 # the embedded random-weight hybrid model
    jha generate --model DIR --prompt-file prompts.txt --json      # a transformers checkpoint directory
    jha compare --model DIR --dtype bfloat16 --steps 8            # the JAX model against transformers, per layer

Without ``--model`` it runs a small embedded hybrid model (sliding-window and full layers) with random weights and
a byte-level tokenizer, so nothing is downloaded; its text is noise, its serving path is the real one. A
progress bar over the batch goes to stderr; the report (or with ``--json`` one JSON object and nothing else) to
stdout.

Compiled steps are kept across processes in ``$XDG_CACHE_HOME/jax_hybrid_attn`` (``~/.cache/jax_hybrid_attn``), or
in ``--compilation-cache DIR`` or ``$JHA_COMPILATION_CACHE``, so that a second run starts without compiling:
``--no-compilation-cache`` (or ``JHA_COMPILATION_CACHE=off``) keeps none. An entry is keyed by this package's
source, JAX's version, the device and the engine's options; delete the directory to reclaim its space.

``jha compare`` (the ``torch`` extra) runs `models.compare.compare_with_transformers`: it prints the table of
per-layer differences (or with ``--json`` the report as one JSON object) and exits with 0 when every difference is
within tolerance and the float32 greedy tokens agree, 1 when not (the report names the first layer beyond
tolerance), 2 on an error (an unsupported model type, a bad option, torch missing).
"""

import argparse
import json
import os
import re
import sys
import time

import numpy as np

__all__ = ["main"]

PROCESS_START = time.perf_counter()  # (about) when the process started: this module is imported first

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Sliding-window attention keeps only",
    "def fibonacci(n):",
    "In a hybrid model, full-attention layers",
)
KV_CACHE_DTYPE_NAMES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}  # vLLM's names
COMPILATION_CACHE_VARIABLE = "JHA_COMPILATION_CACHE"
"""The compilation cache's directory when ``--compilation-cache`` is not given; "off" (or empty) for none."""
CACHE_SUBDIRECTORY = "jax_hybrid_attn"  # under $XDG_CACHE_HOME, else ~/.cache
MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def memory_size(text: str) -> int:
    """Bytes from "4GiB", "512MB", "1e9" (argparse type)."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in MEMORY_UNITS:
        raise argparse.ArgumentTypeError(f"--kv-memory={text!r}: a size such as 4GiB, 512MB or 1e9")
    return int(float(match.group(1)) * MEMORY_UNITS[unit])


def token_id_lists(text: str) -> list[list[int]]:
    """``--prompt-token-ids '[[1, 2], [3]]'`` (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--prompt-token-ids is not JSON: {error}") from None
    if not isinstance(value, list) or not all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value
    ):
        raise argparse.ArgumentTypeError(f"--prompt-token-ids={text!r} must be a JSON list of lists of ints")
    return value


def token_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` (argparse type): token ids separated by commas or spaces."""
    parts = [p for p in re.split(r"[\s,]+", text.strip().strip("[]")) if p]
    if not parts or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise argparse.ArgumentTypeError(f"--prompt-ids={text!r} must be token ids such as 1,2,3")
    return [int(p) for p in parts]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine options that ``jha generate`` and ``jha serve`` share."""
    g = parser
    g.add_argument("--model", help="a transformers checkpoint directory (default: the embedded random model)")
    g.add_argument("--seed", type=int, default=0,
                   help="the embedded model's random weights, and the seeds of requests that give none")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the token budget of a step (default: 8192 on a GPU, 512 elsewhere)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests in flight at once (default: 256 on a GPU, 16 elsewhere)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16, or less where the model's chunks need it)")  # fmt: skip
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model's heads and MLP over N devices (--kv-memory is then per device)")  # fmt: skip
    pool = g.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, help="KV blocks in the pool")
    pool.add_argument("--kv-memory", type=memory_size, help="KV memory, e.g. 2GiB")
    g.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                   help="allocate sliding-window and chunked layers as such (--no-hybrid: all as full attention)")  # fmt: skip
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and cache (default: bfloat16 on a GPU, float32 elsewhere)")  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPE_NAMES), default="auto",
                   help="auto: the model's; fp8 (fp8_e4m3): float8_e4m3fn, half the bytes, K/V divided by the "
                        "checkpoint's scales or 1")  # fmt: skip
    g.add_argument("--decode-steps", type=int, default=1, metavar="K",
                   help="decode steps per device call when every request decodes (default: 1)")  # fmt: skip
    g.add_argument("--cascade-attention", choices=("auto", "always", "off"), default="auto",
                   help="a prompt prefix every decode shares, read once per step (default: auto, where it pays)")  # fmt: skip
    g.add_argument("--unroll-decode-layers", action="store_true",
                   help="decode steps with the layers unrolled: no copies of weights, a longer compile")  # fmt: skip
    cache = g.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", metavar="DIR",
                       help="keep compiled steps in DIR (JAX's persistent compilation cache, every entry and XLA's "
                            f"GPU autotuning kept): later runs start faster (default: ${COMPILATION_CACHE_VARIABLE}, "
                            f"else $XDG_CACHE_HOME/{CACHE_SUBDIRECTORY} or ~/.cache/{CACHE_SUBDIRECTORY})")  # fmt: skip
    cache.add_argument("--no-compilation-cache", action="store_true", help="compile every step, keep none")


def default_compilation_cache() -> str | None:
    """Where compiled steps are kept without ``--compilation-cache``: ``$JHA_COMPILATION_CACHE`` (None for "off"
    or empty), else ``$XDG_CACHE_HOME/jax_hybrid_attn``, else ``~/.cache/jax_hybrid_attn``."""
    chosen = os.environ.get(COMPILATION_CACHE_VARIABLE)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off") else chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_SUBDIRECTORY)


def enable_compilation_cache(args, *, log=None) -> None:
    """Resolve ``args.compilation_cache`` (``--compilation-cache DIR``, else `default_compilation_cache`; None with
    ``--no-compilation-cache``) and point JAX's persistent cache there, before anything compiles. A default directory
    that cannot be written is left out with a warning; a ``--compilation-cache`` that cannot, raises ValueError."""
    given = args.compilation_cache
    directory = None if args.no_compilation_cache else given or default_compilation_cache()
    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(f"{directory!r} is not writable")
        except OSError as error:
            if given:
                raise ValueError(f"--compilation-cache={given!r} cannot be written: {error}") from error
            print(f"warning: the compilation cache {directory!r} cannot be written ({error}): every step compiles "
                  f"(set {COMPILATION_CACHE_VARIABLE} or --compilation-cache, or --no-compilation-cache)",
                  file=log or sys.stderr)  # fmt: skip
            directory = None
    args.compilation_cache = directory
    if directory is not None:
        from .engine.step_cache import use_compilation_cache

        use_compilation_cache(directory)


def make_engine_config(args):
    """The `EngineConfig` of the options `add_engine_arguments` defines."""
    from .engine import EngineConfig

    return EngineConfig(
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        kv_memory=args.kv_memory, hybrid=args.hybrid, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, tensor_parallel=args.tensor_parallel, decode_steps=args.decode_steps,
        cascade_attention=args.cascade_attention, kv_cache_dtype=KV_CACHE_DTYPE_NAMES[args.kv_cache_dtype],
        unroll_decode_layers=args.unroll_decode_layers,
        compilation_cache=args.compilation_cache and os.path.join(args.compilation_cache, "jha-steps"),
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from .serve import add_serve_arguments

    parser = argparse.ArgumentParser(prog="jha", description="jax_hybrid_attn: paged attention serving in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="generate text for prompts with the continuous-batching engine")
    add_engine_arguments(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompt-file", help="a file with one prompt per line")
    g.add_argument("--prompt-token-ids", type=token_id_lists, help="prompts as token ids: '[[1, 2], [3, 4]]'")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--warmup", action="store_true",
                   help="run the batch once first, then time a second run with a cold prefix cache")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print one JSON object and nothing else on stdout")
    g.add_argument("--no-progress", action="store_true")
    s = commands.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine (the serve extra)")
    add_engine_arguments(s)
    add_serve_arguments(s)
    add_compare_arguments(commands.add_parser(
        "compare", help="the JAX model of a checkpoint against transformers, layer by layer (the torch extra)"))
    return parser


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``jha compare``'s options (`models.compare.compare_with_transformers`' arguments, which it checks; unset:
    its defaults). The parser imports nothing of the models: every command parses its arguments first."""
    c = parser
    c.add_argument("--model", required=True, help="a transformers checkpoint directory")
    c.add_argument("--prompt", action="append", default=[], help="a prompt, through the checkpoint's tokenizer "
                   "(repeatable; none: random token ids around each window and chunk of the config)")  # fmt: skip
    c.add_argument("--prompt-ids", action="append", type=token_ids, default=[], metavar="IDS",
                   help="a prompt as token ids, e.g. 1,2,3 (repeatable)")  # fmt: skip
    c.add_argument("--dtype", help="the second run's dtype, after float32's: bfloat16 (the default) or float32 "
                   "(that run only)")  # fmt: skip
    c.add_argument("--steps", type=int, help="greedy tokens compared per prompt (default: 8; 0: none)")
    c.add_argument("--seed", type=int, default=0, help="the default prompts' seed")
    c.add_argument("--torch-device", default="cpu", help="where transformers runs (default: cpu)")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object and nothing else")


def percentiles(values) -> dict[str, float] | None:
    if not len(values):
        return None
    return {f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99)}


def report(engine, outputs, wall_seconds: float, startup: dict) -> dict:
    """The run's metrics as a JSON-ready dict; `startup` holds the seconds before serving (import, load, compile)."""
    stats = engine.stats
    layout = engine.layout
    groups: dict = {}  # KV-cache groups of one spec, together
    for group in layout.kv_config.kv_cache_groups:
        spec = group.kv_cache_spec
        entry = groups.setdefault(spec, {"spec": type(spec).__name__, "groups": 0, "layers": 0, **{
            k: getattr(spec, k) for k in ("sliding_window", "attention_chunk_size") if hasattr(spec, k)}})  # fmt: skip
        entry["groups"] += 1
        entry["layers"] += len(group.layer_names)
    peak_bytes = stats.peak_blocks_in_use * layout.block_bytes
    full_bytes = stats.peak_blocks_full_attention * layout.block_bytes
    ran = [o for o in outputs if o.error is None]
    return {
        "requests": len(outputs),
        "refused": len(outputs) - len(ran),
        "wall_s": wall_seconds,
        "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "startup_s": {k: v for k, v in startup.items() if k != "first_token_since_start"},
        "first_token_since_start_s": startup.get("first_token_since_start"),
        "step_shapes": [str(shape) for shape in engine.runner.shapes],
        "compile_s": stats.compile_time,
        "compiled_executables": stats.compiled_executables,
        "output_tokens_per_s": sum(len(o.output_token_ids) for o in ran) / wall_seconds if wall_seconds else None,
        "ttft_s": percentiles([o.time_to_first_token for o in ran if o.time_to_first_token is not None]),
        "itl_s": percentiles([t for o in ran for t in o.inter_token_latencies]),
        "kv_cache": {
            "hybrid": engine.config.hybrid,
            "dtype": layout.dtype.name,
            "num_blocks": layout.num_blocks,
            "block_size": engine.config.block_size,
            "bytes": layout.total_bytes,
            "tensor_parallel": engine.config.tensor_parallel,
            "bytes_per_device": layout.total_bytes // engine.config.tensor_parallel,
            "groups": list(groups.values()),
            "block_bytes": layout.block_bytes,
            "peak_blocks_in_use": stats.peak_blocks_in_use,
            "peak_blocks_full_attention": stats.peak_blocks_full_attention,
            "peak_bytes_in_use": peak_bytes,
            "peak_bytes_full_attention": full_bytes,
        },
        "prefix_cache_hit_rate": stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "preemptions": stats.preemptions,
    }


def print_report(metrics: dict, outputs, tokenizer, file) -> None:
    from .models import model_line

    for i, output in enumerate(outputs):
        if output.error is not None:
            print(f"[{i}] refused: {output.error}", file=file)
        else:
            print(f"[{i}] {tokenizer.decode(output.output_token_ids)!r}", file=file)
    kv = metrics["kv_cache"]
    fmt = lambda p: "-" if p is None else " / ".join(f"{v * 1e3:.1f}" for v in p.values())  # noqa: E731
    rate = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    saved = kv["peak_blocks_full_attention"] - kv["peak_blocks_in_use"]
    lines = [
        "",
        model_line(metrics["model"]) if "model" in metrics else "",
        f"requests {metrics['requests']} ({metrics['refused']} refused) in {metrics['wall_s']:.2f} s",
        f"tokens/s: prefill {rate(metrics['prefill_tokens_per_s'])}, decode {rate(metrics['decode_tokens_per_s'])}, "
        f"output {rate(metrics['output_tokens_per_s'])}",
        f"TTFT p50/p90/p99 ms: {fmt(metrics['ttft_s'])}    ITL p50/p90/p99 ms: {fmt(metrics['itl_s'])}",
        f"KV cache ({'hybrid' if kv['hybrid'] else 'every layer as full attention'}): {kv['num_blocks']} blocks of "
        f"{kv['block_size']} tokens, {kv['dtype']}, {kv['bytes'] / 2**20:.1f} MiB"
        + (f" ({kv['bytes_per_device'] / 2**20:.1f} MiB on each of {kv['tensor_parallel']} devices)"
           if kv["tensor_parallel"] > 1 else ""),  # fmt: skip
    ]
    for group in kv["groups"]:
        extra = "".join(f", {k} {v}" for k, v in group.items() if k not in ("spec", "layers", "groups"))
        lines.append(f"  {group['groups']} group(s) of {group['spec']}: {group['layers']} layers{extra}")
    lines += [
        f"peak KV in use {kv['peak_blocks_in_use']} blocks ({kv['peak_bytes_in_use'] / 2**20:.2f} MiB); the same requests "
        f"with every layer as full attention: {kv['peak_blocks_full_attention']} ({saved} blocks saved)",
        "startup: " + ", ".join(f"{k} {v:.1f} s" for k, v in metrics["startup_s"].items())
        + f"; {metrics['compiled_executables']} executables compiled before serving (step shapes: "
        + ", ".join(metrics["step_shapes"]) + ")",
        f"prefix-cache hit rate {metrics['prefix_cache_hit_rate']:.1%}, preemptions {metrics['preemptions']}",
    ]
    print("\n".join(lines), file=file)


def model_dtype(args):
    """The dtype of the model's weights and activations: ``--dtype``, else bfloat16 on a GPU and float32 elsewhere."""
    import jax
    import jax.numpy as jnp

    return jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))


def model_config(args):
    """The `ModelConfig` of ``--model`` (its config.json) or of the embedded default."""
    from .models import ModelConfig, embedded_config

    return embedded_config() if args.model is None else ModelConfig.from_dir(args.model)


def load(args, *, plan=None):
    """(model config, model) from ``--model`` (`plan`: its `CheckpointPlan`) or the embedded default."""
    from flax import nnx

    from .models import Decoder, embedded_config, load_model

    dtype = model_dtype(args)
    if args.model is None:
        config = embedded_config()
        return config, Decoder(config, rngs=nnx.Rngs(args.seed), dtype=dtype, param_dtype=dtype)
    return load_model(args.model, dtype=dtype, plan=plan)


def prompt_token_lists(args, tokenizer) -> list[list[int]]:
    """The prompts of ``--prompt``, ``--prompt-file`` and ``--prompt-token-ids`` (none: `DEFAULT_PROMPTS`)."""
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    token_lists = [tokenizer.encode(p) for p in prompts] + list(args.prompt_token_ids or [])
    return token_lists or [tokenizer.encode(p) for p in DEFAULT_PROMPTS]


def refuse_if_nothing_runs(token_lists, config, max_model_len: int) -> None:
    """Raise the first prompt's refusal (`engine.prompts.check_prompt`) when the engine would refuse every one."""
    from .engine.prompts import check_prompt

    errors = []
    for tokens in token_lists:
        try:
            check_prompt(tokens, model_config=config, max_model_len=max_model_len)
        except (ValueError, NotImplementedError) as error:
            errors.append(error)
    if token_lists and len(errors) == len(token_lists):
        raise type(errors[0])(f"every prompt would be refused ({len(errors)}); the first: {errors[0]}")


def generate(args, out=None, err=None) -> dict:
    out, err = out or sys.stdout, err or sys.stderr
    from tqdm import tqdm

    started = time.perf_counter()
    import jax

    from .engine import Engine, SamplingParams, lower_ahead
    from .engine.engine import resolve
    from .models import describe_model, load_tokenizer, model_line, plan_checkpoint

    enable_compilation_cache(args)
    startup = {"import": time.perf_counter() - started}
    started = time.perf_counter()
    engine_config = make_engine_config(args)
    plan = None if args.model is None else plan_checkpoint(args.model)  # no tensor read yet
    config = model_config(args) if plan is None else plan.config
    tokenizer = load_tokenizer(args.model)
    token_lists = prompt_token_lists(args, tokenizer)
    refuse_if_nothing_runs(token_lists, config, resolve(config, engine_config)[1])  # before loading or compiling
    description = describe_model(config, plan=plan)
    print(model_line(description), file=err)
    lowering = lower_ahead(config, engine_config, dtype=model_dtype(args))  # while the weights load
    config, model = load(args, plan=plan)
    jax.block_until_ready(nnx_leaves(model))
    startup["load"] = time.perf_counter() - started
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=None, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    engine = Engine(model, config, engine_config, eos_token_ids=tokenizer.eos_token_ids, lowering=lowering)
    del model  # the engine keeps its own layout of the weights
    startup["engine"] = time.perf_counter() - started - startup["load"]
    names = engine.runner.executable_keys()
    shapes = ", ".join(map(str, engine.runner.shapes))
    with tqdm(total=len(names), desc=f"compiling (step shapes {shapes})", unit="fn", file=err,
              disable=args.no_progress) as compiling:  # fmt: skip
        report_compile = engine.compile(progress=lambda _: compiling.update(1))
    startup["compile"] = report_compile.wall_s
    startup["lowering"] = report_compile.lowering_s
    compile_timeline = {name: {"lowered_at_s": ready, "compiled_at_s": done}
                        for name, (ready, done) in report_compile.timeline.items()}  # fmt: skip
    if args.warmup:
        engine.generate(token_lists, sampling)
        engine.reset()
    bar = tqdm(total=len(token_lists), desc="requests", unit="req", file=err, disable=args.no_progress)
    first_token = []
    started = time.perf_counter()
    outputs = engine.generate(token_lists, sampling, on_finish=lambda _: bar.update(1),
                              on_token=lambda *_: first_token or first_token.append(time.perf_counter()))  # fmt: skip
    wall = time.perf_counter() - started
    startup["first_token_since_start"] = first_token[0] - PROCESS_START if first_token else None
    bar.close()
    metrics = report(engine, outputs, wall, startup)
    metrics["model"] = description
    metrics["compile_timeline"] = compile_timeline
    if args.json:
        payload = {
            "outputs": [
                {"prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.output_token_ids,
                 "text": tokenizer.decode(o.output_token_ids), "finish_reason": o.finish_reason, "error": o.error}
                for o in outputs
            ],
            "metrics": metrics,
        }  # fmt: skip
        print(json.dumps(payload), file=out)
    else:
        for o in outputs:
            if o.error is not None:
                print(f"refused: {o.error}", file=err)
        print_report(metrics, outputs, tokenizer, out)
    return metrics


def compare(args, out=None):
    """``jha compare``: print the `ComparisonReport`'s table (or its JSON) and return the report."""
    from .models.compare import compare_with_transformers

    out = out or sys.stdout
    prompts = [*args.prompt, *args.prompt_ids] or None
    given = {"dtype": args.dtype, "greedy_steps": args.steps}
    options = {name: value for name, value in given.items() if value is not None}
    report = compare_with_transformers(args.model, prompts=prompts, seed=args.seed, torch_device=args.torch_device,
                                       **options)  # fmt: skip
    print(json.dumps(report.to_dict()) if args.json else report.table(), file=out)
    return report


def nnx_leaves(model) -> list:
    """The model's weight arrays (to wait for their transfer)."""
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    errors = (ValueError, NotImplementedError, FileNotFoundError)
    if args.command == "serve":
        from .serve import serve as run  # FastAPI and uvicorn only for the server
    elif args.command == "compare":
        run, errors = compare, (*errors, ImportError)  # torch and transformers missing: the torch extra
    else:
        run = generate
    try:
        result = run(args)
    except errors as error:
        print(f"jha {args.command}: error: {error}", file=sys.stderr)
        return 2
    if args.command == "compare" and not result.passed:
        return 1  # beyond tolerance: the table says where
    return 0


if __name__ == "__main__":
    sys.exit(main())
