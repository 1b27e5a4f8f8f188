"""``jha serve``: the engine process, the request streams and the app from the command line's options
(`build_server`), and uvicorn serving them (`run`).

The server's address is taken first (a port in use fails at once: `ServerNotStarted`). The engine process then
checks the options and loads the model as ``jha generate`` does (the same options,
`jax_hybrid_attn.engine_options.add_engine_arguments`, through `build_engine`); once it has, the server listens
while the engine compiles its step shapes (``/health`` says 503 until they are, and the log counts them), then
serves.
"""

import argparse
import dataclasses
import logging
import socket
import sys
from pathlib import Path

import jax

from ..engine import Engine
from ..extras import MissingExtraError
from ..models import MissingTokenizer
from . import SERVE_GPU_STEP_TOKENS, ServerNotStarted
from .app import build_app
from .chat_template import load_chat_template
from .engine_process import EngineProcess, freeze_startup_heap
from .metrics import ServerMetrics
from .openai_serving import OpenAIServing
from .request_streams import RequestStreams

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "Server",
    "ServerOptions",
    "build_engine",
    "build_server",
    "listening_socket",
    "run",
    "server_options",
]

BAD_INPUT_ERRORS = (ValueError, NotImplementedError, OSError, MissingExtraError)
"""What the engine process raises for options or a checkpoint it cannot serve (``jha`` exits with 2); anything
else stopping it before it serves is `ServerNotStarted` (3)."""

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


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What ``jha serve``'s own options give, read and checked before anything else starts (`server_options`)."""

    chat_template: object
    tokenizer: object


def server_options(args: argparse.Namespace) -> ServerOptions:
    """``jha serve``'s own options checked and read (``--max-n``, the chat template, the checkpoint's tokenizer,
    which the server needs to write text); the engine process checks the engine's before it reads any weight."""
    from ..models import load_tokenizer

    if args.max_n < 1:
        raise ValueError(f"--max-n={args.max_n} must be at least 1")
    chat_template = load_chat_template(args.model, override=args.chat_template)
    tokenizer = load_tokenizer(args.model)
    if isinstance(tokenizer, MissingTokenizer):
        raise tokenizer.error
    return ServerOptions(chat_template, tokenizer)


def build_server(args: argparse.Namespace, *, log=sys.stderr, options: ServerOptions | None = None) -> Server:
    """The server of ``jha serve``'s options (`options`: `server_options` of them, when read already), once its
    engine process has checked them and loaded the model (what it raised for bad options or a bad checkpoint, it
    raises; `ServerNotStarted` for any other failure); the engine compiles meanwhile and after."""
    options = options or server_options(args)
    engine = EngineProcess(args).start()
    try:
        engine.wait_loaded()
    except BAD_INPUT_ERRORS:
        engine.stop()
        raise
    except BaseException as error:
        engine.stop()
        if isinstance(error, KeyboardInterrupt):
            raise
        raise ServerNotStarted(f"the engine process failed while loading the model: {error}") from error
    metrics = ServerMetrics(snapshot=lambda: engine.snapshot)
    name = served_model_name(args)
    serving = OpenAIServing(RequestStreams(engine, observer=metrics), tokenizer=options.tokenizer, model_name=name,
                            chat_template=options.chat_template, max_n=args.max_n)  # fmt: skip
    if options.chat_template is None:
        print(f"{name}: no chat template (/v1/chat/completions answers 400)", file=log)
    return Server(build_app(serving, metrics=metrics), engine, serving, metrics)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` for uvicorn to listen on (taken before the model loads, so that an address
    in use fails at once); `ServerNotStarted` when it cannot be bound."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = addresses[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise ServerNotStarted(f"cannot listen on {host}:{port}: {error}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ServerNotStarted(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def run(args: argparse.Namespace) -> None:
    """Take ``--host``:``--port``, build the server and serve it with uvicorn until interrupted."""
    import uvicorn

    options = server_options(args)
    sock = listening_socket(args.host, args.port)
    try:
        port = sock.getsockname()[1]
        print(f"jha serve: listening on http://{args.host}:{port} once the model is loaded", file=sys.stderr)
        server = build_server(args, options=options)
        freeze_startup_heap()  # the imported modules, the tokenizer: a burst's collections walk only what it made
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        ready = "GET /health says 200 once the engine has compiled; the log counts the step functions as they compile"
        print(f"serving {server.serving.model_name} on http://{args.host}:{port}/v1 ({ready})", file=sys.stderr)
        config = uvicorn.Config(server.app, host=args.host, port=port, log_level=args.log_level)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
