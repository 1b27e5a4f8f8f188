"""``jha serve``: the engine process, the request streams and the app from the command line's options
(`build_server`), and uvicorn serving them (`run`).

The engine process loads the model as ``jha generate`` loads it (the same options,
`jax_hybrid_attn.engine_options.add_engine_arguments`, through `build_engine`); once it has, the server listens
while the engine compiles its step shapes (``/health`` says 503 until they are), then serves.
"""

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import jax

from ..engine import Engine
from . import SERVE_GPU_STEP_TOKENS
from .app import build_app
from .chat_template import load_chat_template
from .engine_process import EngineProcess, freeze_startup_heap
from .metrics import ServerMetrics
from .openai_serving import OpenAIServing
from .request_streams import RequestStreams

__all__ = ["EMBEDDED_MODEL_NAME", "Server", "build_engine", "build_server", "run"]

EMBEDDED_MODEL_NAME = "jha-embedded-hybrid"
"""The served name of the embedded random-weight model (no ``--model``)."""

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Server:
    """What ``jha serve`` runs: the FastAPI `app`, its `engine` process (stopped by the app's lifespan), the
    `serving` endpoints and the `metrics`."""

    app: object
    engine: EngineProcess
    serving: OpenAIServing
    metrics: ServerMetrics


def build_engine(args: argparse.Namespace, *, log=sys.stderr) -> tuple[Engine, object]:
    """(the engine, its tokenizer) of the engine options (as ``jha generate`` builds them, but for the token budget
    of a step on a GPU, `SERVE_GPU_STEP_TOKENS` unless ``--max-num-batched-tokens`` is given); not compiled yet."""
    from ..engine_options import load_planned, plan_model

    if args.max_num_batched_tokens is None and jax.default_backend() == "gpu":
        args = argparse.Namespace(**{**vars(args), "max_num_batched_tokens": SERVE_GPU_STEP_TOKENS})
    planned = plan_model(args, log=log)
    config, model, lowering = load_planned(args, planned)
    engine_config, tokenizer = planned.engine_config, planned.tokenizer
    engine = Engine(model, config, engine_config, eos_token_ids=tokenizer.eos_token_ids, lowering=lowering)
    return engine, tokenizer


def served_model_name(args: argparse.Namespace) -> str:
    """``--served-model-name``, else the checkpoint directory's name, else `EMBEDDED_MODEL_NAME`."""
    if args.served_model_name:
        return args.served_model_name
    return EMBEDDED_MODEL_NAME if args.model is None else Path(args.model).resolve().name


def build_server(args: argparse.Namespace, *, log=sys.stderr) -> Server:
    """The server of ``jha serve``'s options, once its engine process has loaded the model (what loading raised,
    it raises); the engine compiles meanwhile and after."""
    from ..models import load_tokenizer

    if args.max_n < 1:
        raise ValueError(f"--max-n={args.max_n} must be at least 1")
    chat_template = load_chat_template(args.model, override=args.chat_template)
    tokenizer = load_tokenizer(args.model)
    engine = EngineProcess(args).start()
    try:
        engine.wait_loaded()
    except BaseException:
        engine.stop()
        raise
    metrics = ServerMetrics(snapshot=lambda: engine.snapshot)
    name = served_model_name(args)
    serving = OpenAIServing(RequestStreams(engine, observer=metrics), tokenizer=tokenizer, model_name=name,
                            chat_template=chat_template, max_n=args.max_n)  # fmt: skip
    if chat_template is None:
        print(f"{name}: no chat template (/v1/chat/completions answers 400)", file=log)
    return Server(build_app(serving, metrics=metrics), engine, serving, metrics)


def run(args: argparse.Namespace) -> None:
    """Build the server and serve it with uvicorn on ``--host``:``--port`` until interrupted."""
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} must be in [0, 65535]")
    server = build_server(args)
    freeze_startup_heap()  # the imported modules, the tokenizer: a burst's collections walk only what it made
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print(f"serving {server.serving.model_name} on http://{args.host}:{args.port}/v1 (GET /health says 200 once "
          "the engine has compiled)", file=sys.stderr)  # fmt: skip
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
