"""The model and engine options that ``jha generate`` and ``jha serve`` share: their flags, the `EngineConfig` they
make, the compilation cache they keep, and the model they name (a checkpoint or the embedded default).

Compiled steps are kept across processes in ``$XDG_CACHE_HOME/jax_hybrid_attn`` (``~/.cache/jax_hybrid_attn``), or
in ``--compilation-cache DIR`` or ``$JHA_COMPILATION_CACHE``, so that a second run starts without compiling:
``--no-compilation-cache`` (or ``JHA_COMPILATION_CACHE=off``) keeps none. An entry is keyed by this package's
source, JAX's version, the device and the engine's options; delete the directory to reclaim its space.
"""

import argparse
import dataclasses
import os
import re
import sys

__all__ = ["ModelPlan", "add_engine_arguments", "enable_compilation_cache", "load", "load_planned",
           "make_engine_config", "model_config", "model_dtype", "plan_model"]

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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine options that ``jha generate`` and ``jha serve`` share."""
    g = parser
    g.add_argument("--model", help="a transformers checkpoint directory (default: the embedded random model)")
    g.add_argument("--seed", type=int, default=0,
                   help="the embedded model's random weights, and the seeds of requests that give none")  # fmt: skip
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="a step's token budget (default: 8192 on a GPU, jha serve 2048; 512 elsewhere)")  # fmt: skip
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
    g.add_argument("--cublas-matmuls", action=argparse.BooleanOptionalAction, default=True,
                   help="the model's matmuls on cuBLAS, reading each scanned layer's weights in place, or on XLA's "
                        "Triton GEMMs, which copy them out first (GPU; default: cuBLAS)")  # fmt: skip
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
        cublas_matmuls=args.cublas_matmuls,
        compilation_cache=args.compilation_cache and os.path.join(args.compilation_cache, "jha-steps"),
    )  # fmt: skip


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


def nnx_leaves(model) -> list:
    """The model's weight arrays (to wait for their transfer)."""
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """What the options name, checked before any weight is read (`plan_model`).

    Attributes:
      engine_config: the `EngineConfig` of the options.
      plan: the checkpoint's `CheckpointPlan` (None for the embedded model).
      config: the model's `ModelConfig`.
      tokenizer: its tokenizer (the byte tokenizer for the embedded model; its ``source`` says which).
      description: `models.describe_model` of it.
      max_model_len: the engine's ``max_model_len`` (resolved: the option, else the model's and the engine's).
    """

    engine_config: object
    plan: object
    config: object
    tokenizer: object
    description: dict
    max_model_len: int


def plan_model(args, *, log=None) -> ModelPlan:
    """The compilation cache enabled (`enable_compilation_cache`), the `EngineConfig`, the checkpoint's plan,
    config and tokenizer, and the engine's sizes checked against the model and the devices
    (`engine.check_engine_config`), all before any tensor is read; the model's line and the tokenizer's printed
    to `log` (stderr)."""
    from .engine import check_engine_config
    from .models import describe_model, load_tokenizer, model_line, plan_checkpoint

    log = log or sys.stderr
    enable_compilation_cache(args, log=log)
    engine_config = make_engine_config(args)
    plan = None if args.model is None else plan_checkpoint(args.model)
    config = model_config(args) if plan is None else plan.config
    max_model_len = check_engine_config(config, engine_config, dtype=model_dtype(args))
    tokenizer = load_tokenizer(args.model)
    description = describe_model(config, plan=plan)
    print(model_line(description), file=log)
    print(f"tokenizer: {tokenizer.source}", file=log)
    return ModelPlan(engine_config, plan, config, tokenizer, description, max_model_len)


def load_planned(args, planned: ModelPlan):
    """(model config, model on the device, the step functions' lowering): the lowering starts first
    (`engine.lower_ahead`, in worker processes on a GPU), so that it runs while the weights load."""
    import jax

    from .engine import lower_ahead

    lowering = lower_ahead(planned.config, planned.engine_config, dtype=model_dtype(args))
    config, model = load(args, plan=planned.plan)
    jax.block_until_ready(nnx_leaves(model))
    return config, model, lowering
