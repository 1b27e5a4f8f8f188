"""Engines without a model for the server's tests, importable by an engine process (`EngineProcess(build=...)`)."""

import time
from types import SimpleNamespace

from jax_hybrid_attn.engine import EngineStats
from jax_hybrid_attn.models import embedded_config

STEP_S = 0.02
"""How long a step of `SteppingEngine` takes."""
TOKEN = 97


class SteppingEngine:
    """Just enough of an `Engine` for the engine loop: each step gives every request one token (`TOKEN`) until
    its ``max_tokens``."""

    def __init__(self):
        self.stats, self.model_config, self.max_model_len = EngineStats(), embedded_config(), 64
        self.layout, self.runner = SimpleNamespace(num_blocks=4), SimpleNamespace(compiled=True)
        self.scheduler, self.manager = SimpleNamespace(running=[], waiting=[]), SimpleNamespace(num_free_blocks=3)
        self.left: dict = {}

    def has_unfinished_requests(self):
        return bool(self.left)

    def add_request(self, prompt_token_ids, sampling, *, request_id):
        self.left[request_id] = sampling.max_tokens

    def abort_request(self, request_id):
        self.left.pop(request_id, None)

    def synchronize(self):
        pass

    def step(self, on_token=None):
        time.sleep(STEP_S)
        finished = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            if on_token is not None:
                on_token(request_id, TOKEN)
            if not self.left[request_id]:
                del self.left[request_id]
                finished.append(SimpleNamespace(request_id=request_id, finish_reason="length"))
        self.stats.steps += 1
        return finished


def build_stepping_engine(args, *, log):
    return SteppingEngine(), None


def build_nothing(args, *, log):
    raise ValueError(f"--model={args.model!r}: no config.json there")


def unfinished_requests(engine) -> int:
    return len(engine.left)
