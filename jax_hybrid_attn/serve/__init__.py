"""``jha serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the continuous-batching engine.

  * `protocol`: OpenAI's request and response bodies (pydantic); `errors`: its error JSON;
  * `engine_loop`: one thread owns and steps the engine; requests and aborts reach it through a thread-safe
    queue, each step's tokens go back as events; `engine_process`: that loop in a process of its own (what
    ``jha serve`` runs); `request_streams`: the events into each request's asyncio queue, and its timings;
  * `text`: tokens to text as they arrive, and stop strings; `chat_template`: a checkpoint's chat template;
  * `openai_serving`: completions and chat completions on the engine loop (choices, usage, streaming);
  * `metrics`: Prometheus metrics in a registry of the server's own;
  * `app`: the FastAPI routes; `server`: the engine process and the app from ``jha serve``'s options, and
    uvicorn.

FastAPI, uvicorn, jinja2 and prometheus_client (the ``serve`` extra) are imported by those modules only: this
package's own import, which ``jha``'s argument parser needs, imports none of them.
"""

import argparse

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "MAX_CHOICES",
    "SERVE_GPU_STEP_TOKENS",
    "ServerNotStarted",
    "add_serve_arguments",
    "serve",
]

DEFAULT_HOST = "127.0.0.1"
"""Where ``jha serve`` listens unless ``--host`` says otherwise (loopback: nothing is exposed by default)."""
DEFAULT_PORT = 8000
MAX_CHOICES = 16
"""The largest ``n`` (choices per prompt) a request may ask for, unless ``--max-n`` says otherwise."""
SERVE_GPU_STEP_TOKENS = 2048
"""``jha serve``'s ``--max-num-batched-tokens`` on a GPU when none is given (``jha generate`` takes the engine's
8,192). A step that carries prefill chunks then takes at most about twice a decode step, so that the streams already
decoding keep an even pace while a burst of prompts is admitted: a lower inter-token latency at its tail for some
throughput, the trade that vLLM's ``--max-num-batched-tokens`` makes (benchmarks/RESULTS.md, "`jha serve` under
load", measures both budgets)."""


class ServerNotStarted(RuntimeError):
    """``jha serve`` could not start: its address cannot be listened on, or the engine process failed for a reason
    other than its options (``jha`` exits with 3)."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``jha serve``'s own options (the engine's come from `jax_hybrid_attn.engine_options.add_engine_arguments`)."""
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"the address to listen on (default: {DEFAULT_HOST})")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"(default: {DEFAULT_PORT})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the --model directory's name, or the "
                             "embedded model's)")  # fmt: skip
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template, or a file holding one (default: the checkpoint's, from "
                             "tokenizer_config.json or chat_template.jinja)")  # fmt: skip
    parser.add_argument("--max-n", type=int, default=MAX_CHOICES,
                        help=f"the most choices (n) one request may ask for (default: {MAX_CHOICES})")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def port_number(text: str) -> int:
    """``--port`` (argparse type): an integer in [0, 65535] (0: a free port the system picks)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port={text!r} must be an integer in [0, 65535]")
    return port


def serve(args: argparse.Namespace) -> None:
    """Listen on ``--host``:``--port``, load the model, compile the engine and serve until interrupted
    (`server.run`)."""
    from .server import run

    run(args)
