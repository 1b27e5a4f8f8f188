"""`jha generate` (also ``python -m jax_hybrid_attn generate``): serve prompts with the engine and report.

    jha generate --prompt "Hello" --max-tokens 32                 # the embedded random-weight hybrid model
    jha generate --model DIR --prompt-file prompts.txt --json      # a transformers checkpoint directory
    jha compare --model DIR --dtype bfloat16 --steps 8            # the JAX model against transformers, per layer
    jha save-embedded DIR                                         # the embedded model as a checkpoint directory

Without ``--model`` it runs a small embedded hybrid model (sliding-window and full layers) with random weights and
a byte-level tokenizer, so nothing is downloaded; its text is noise, its serving path is the real one. A
progress bar over the batch goes to stderr; the report (or with ``--json`` one JSON object and nothing else) to
stdout. The model and engine options, shared with ``jha serve``, and the compilation cache that keeps compiled
steps across runs (by default in ``~/.cache/jax_hybrid_attn``): `engine_options`.

``jha compare`` (the ``torch`` extra) runs `models.compare.compare_with_transformers`: it prints the table of
per-layer differences (or with ``--json`` the report as one JSON object) and exits with 1 when a difference is
beyond tolerance or the float32 greedy tokens differ (the report names the first layer beyond tolerance).

Every command checks its arguments before it reads a weight, and exits with 2 and one line on stderr for
bad input (an option, a checkpoint that cannot be read, an extra that is not installed: the line says which
``pip install`` adds it), with 3 when ``jha serve`` cannot start its server (the port is taken), and with 70
(and the traceback) for a failure of the package itself.
"""

import argparse
import importlib.metadata
import json
import re
import sys
import time
import traceback

import numpy as np

from .engine_options import add_engine_arguments, load_planned, plan_model

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_COMPARISON_FAILED",
    "EXIT_INTERNAL_ERROR",
    "EXIT_SERVER_NOT_STARTED",
    "main",
]

EXIT_COMPARISON_FAILED = 1
"""``jha compare``: a difference beyond tolerance, or float32 greedy tokens that differ."""
EXIT_BAD_INPUT = 2
"""A bad option, a checkpoint that cannot be read, an extra that is not installed (argparse's code too)."""
EXIT_SERVER_NOT_STARTED = 3
"""``jha serve``: the server could not start (its address cannot be listened on, the engine process died)."""
EXIT_INTERNAL_ERROR = 70
"""A failure of the package itself (sysexits' EX_SOFTWARE), with its traceback."""
EXIT_INTERRUPTED = 130

PROCESS_START = time.perf_counter()  # (about) when the process started: this module is imported first

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Sliding-window attention keeps only",
    "def fibonacci(n):",
    "In a hybrid model, full-attention layers",
)

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


def package_version() -> str:
    try:
        return importlib.metadata.version("jax-hybrid-attn")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """``jha``'s parser: options spelled out in full (no abbreviations), each checked by its type."""
    from .serve import add_serve_arguments

    description = "jax_hybrid_attn: paged attention serving in JAX"
    parser = argparse.ArgumentParser(prog="jha", description=description, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    add = lambda name, **kwargs: commands.add_parser(name, allow_abbrev=False, **kwargs)  # noqa: E731
    g = add("generate", help="generate text for prompts with the continuous-batching engine")
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
    s = add("serve", help="an OpenAI-compatible HTTP server on the engine (the serve extra)")
    add_engine_arguments(s)
    add_serve_arguments(s)
    add_compare_arguments(add(
        "compare", help="the JAX model of a checkpoint against transformers, layer by layer (the torch extra)"))
    e = add("save-embedded", help="write the embedded random-weight model as a checkpoint directory")
    e.add_argument("directory", help="where to write it (created; it must not hold files)")
    e.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
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


def output_text(tokenizer, token_ids) -> str | None:
    """The text of `token_ids`, or None where the tokenizer cannot be read here (`MissingTokenizer`)."""
    from .models import MissingTokenizer

    return None if isinstance(tokenizer, MissingTokenizer) else tokenizer.decode(token_ids)


def print_report(metrics: dict, outputs, tokenizer, file) -> None:
    from .models import model_line

    for i, output in enumerate(outputs):
        if output.error is not None:
            print(f"[{i}] refused: {output.error}", file=file)
        else:
            text = output_text(tokenizer, output.output_token_ids)
            print(f"[{i}] {output.output_token_ids if text is None else repr(text)}", file=file)
    kv = metrics["kv_cache"]
    fmt = lambda p: "-" if p is None else " / ".join(f"{v * 1e3:.1f}" for v in p.values())  # noqa: E731
    rate = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    saved = kv["peak_blocks_full_attention"] - kv["peak_blocks_in_use"]
    lines = [
        "",
        model_line(metrics["model"]) if "model" in metrics else "",
        f"tokenizer: {metrics['tokenizer']}" if "tokenizer" in metrics else "",
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


def read_prompt_file(path: str) -> list[str]:
    """The prompts of ``--prompt-file``: its non-empty lines. A file that cannot be read, or holds none, is a
    `ValueError`."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--prompt-file={path!r} cannot be read: {error}") from None
    if not prompts:
        raise ValueError(f"--prompt-file={path!r} holds no prompt (one prompt per non-empty line)")
    return prompts


def prompt_texts(args) -> list[str] | None:
    """The text prompts of ``--prompt`` and ``--prompt-file``, in order; None when no prompt is given at all (the
    run takes `DEFAULT_PROMPTS`)."""
    texts = [*args.prompt, *(read_prompt_file(args.prompt_file) if args.prompt_file else [])]
    if not texts and args.prompt_token_ids is not None and not args.prompt_token_ids:
        raise ValueError("--prompt-token-ids='[]' holds no prompt")
    return texts if texts or args.prompt_token_ids else None


def prompt_token_lists(texts: list[str] | None, token_ids: list | None, tokenizer) -> list[list[int]]:
    """`texts` through `tokenizer`, then the `token_ids` prompts (both None: `DEFAULT_PROMPTS`)."""
    if texts is None:
        return [tokenizer.encode(p) for p in DEFAULT_PROMPTS]
    return [tokenizer.encode(p) for p in texts] + list(token_ids or [])


def sampling_params(args):
    """The `SamplingParams` of the sampling options (each checked, named as its option)."""
    from .engine import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=None, ignore_eos=args.ignore_eos)  # fmt: skip
    except ValueError as error:
        option = str(error).split("=", 1)[0].replace("_", "-")
        raise ValueError(f"--{option}: {error}") from None


def refuse_if_nothing_runs(token_lists, config, max_model_len: int) -> list[bool]:
    """Which prompts the engine serves (`engine.prompts.check_prompt`); the first prompt's refusal is raised
    when it would refuse every one."""
    from .engine.prompts import check_prompt

    errors = []
    for tokens in token_lists:
        try:
            check_prompt(tokens, model_config=config, max_model_len=max_model_len)
        except (ValueError, NotImplementedError) as error:
            errors.append(error)
        else:
            errors.append(None)
    refused = [error for error in errors if error is not None]
    if token_lists and len(refused) == len(token_lists):
        raise type(refused[0])(f"every prompt would be refused ({len(refused)}); the first: {refused[0]}")
    return [error is None for error in errors]


def check_room_for_output(token_lists, served: list[bool], *, max_tokens: int, max_model_len: int) -> None:
    """`ValueError` when a served prompt and ``--max-tokens`` output tokens exceed ``max_model_len`` (as the
    server answers such a request with a 400), rather than stopping the output short."""
    for i, (tokens, runs) in enumerate(zip(token_lists, served, strict=True)):
        if runs and len(tokens) + max_tokens > max_model_len:
            raise ValueError(
                f"--max-tokens={max_tokens}: prompt [{i}] has {len(tokens)} tokens and the model's length is "
                f"max_model_len={max_model_len}: give at most --max-tokens {max_model_len - len(tokens)}, or "
                f"--max-model-len {len(tokens) + max_tokens} (at most the model's max_position_embeddings)"
            )


def generate(args, out=None, err=None) -> dict:
    """``jha generate``: every option and prompt checked, then the model loaded, compiled and run; the report
    printed (or its JSON) and returned."""
    out, err = out or sys.stdout, err or sys.stderr
    sampling = sampling_params(args)
    texts = prompt_texts(args)
    from tqdm import tqdm

    started = time.perf_counter()
    from .engine import Engine

    startup = {"import": time.perf_counter() - started}
    started = time.perf_counter()
    planned = plan_model(args, log=err)
    engine_config, tokenizer = planned.engine_config, planned.tokenizer
    token_lists = prompt_token_lists(texts, args.prompt_token_ids, tokenizer)
    served = refuse_if_nothing_runs(token_lists, planned.config, planned.max_model_len)
    max_model_len = planned.max_model_len
    check_room_for_output(token_lists, served, max_tokens=args.max_tokens, max_model_len=max_model_len)
    config, model, lowering = load_planned(args, planned)
    startup["load"] = time.perf_counter() - started
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
    startup["warm_up"] = report_compile.warm_up_s
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
    metrics["model"] = planned.description
    metrics["tokenizer"] = tokenizer.source
    metrics["compile_timeline"] = compile_timeline
    if args.json:
        payload = {
            "outputs": [
                {"prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.output_token_ids,
                 "text": output_text(tokenizer, o.output_token_ids), "finish_reason": o.finish_reason,
                 "error": o.error}
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
    from .extras import require_extra

    require_extra("torch", needed_for="jha compare")
    from .models.compare import compare_with_transformers

    out = out or sys.stdout
    prompts = [*args.prompt, *args.prompt_ids] or None
    given = {"dtype": args.dtype, "greedy_steps": args.steps}
    options = {name: value for name, value in given.items() if value is not None}
    report = compare_with_transformers(args.model, prompts=prompts, seed=args.seed, torch_device=args.torch_device,
                                       **options)  # fmt: skip
    print(json.dumps(report.to_dict()) if args.json else report.table(), file=out)
    return report


def serve(args):
    """``jha serve``: the server, until interrupted (`serve.serve`)."""
    from .extras import require_extra

    require_extra("serve", needed_for="jha serve")
    from .serve import serve as run

    run(args)


def save_embedded(args, out=None) -> None:
    """``jha save-embedded DIR``: the embedded model as a transformers checkpoint directory
    (`models.save_embedded_checkpoint`), for trying ``--model DIR`` without a download."""
    from .models import save_embedded_checkpoint

    path = save_embedded_checkpoint(args.directory, seed=args.seed)
    print(f"wrote the embedded model (seed {args.seed}) to {path}", file=out or sys.stdout)


COMMANDS = {"generate": generate, "serve": serve, "compare": compare, "save-embedded": save_embedded}


def main(argv=None) -> int:
    """Run the ``jha`` command of `argv` (default: the process's arguments); returns the exit code (the module
    docstring lists them)."""
    from .extras import MissingExtraError
    from .serve import ServerNotStarted

    args = build_parser().parse_args(argv)
    name = f"jha {args.command}"
    try:
        result = COMMANDS[args.command](args)
    except ServerNotStarted as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return EXIT_SERVER_NOT_STARTED
    except (ValueError, NotImplementedError, OSError, MissingExtraError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - a failure of the package itself: its traceback, for a bug report
        traceback.print_exc()
        print(f"{name}: internal error (the traceback above; please report it)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    if args.command == "compare" and not result.passed:
        return EXIT_COMPARISON_FAILED  # beyond tolerance: the table says where
    return 0


if __name__ == "__main__":
    sys.exit(main())
