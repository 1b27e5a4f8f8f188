"""Bad input to the engine's options (`EngineConfig`, `SamplingParams`) and to `Engine.add_request`: each
refused with an error that names the argument; numpy scalars and the kernels' interpret parameters taken."""

import numpy as np
import pytest

from jax_hybrid_attn._compat import interpret_params
from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(implementation="x"), "implementation='x' must be None or in"),
        (dict(implementation="Kernel"), "implementation='Kernel'"),
        (dict(interpret="yes"), "interpret='yes' must be a bool"),
        (dict(interpret=1), "interpret=1 must be a bool"),
        (dict(implementation="reference", interpret=True), "interpret=True runs the kernels"),
        (dict(compilation_cache=3), "compilation_cache=3 must be None or a directory"),
        (dict(compilation_cache=""), "compilation_cache='' must be None or a directory"),
        (dict(cascade_attention=None), "cascade_attention=None"),
    ],
)
def test_engine_config_names_a_bad_option(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_engine_config_accepts_numpy_bools_and_interpret_parameters():
    assert EngineConfig(interpret=np.bool_(False)).interpret is False
    assert EngineConfig(interpret=None).interpret is False
    params = interpret_params()
    assert EngineConfig(implementation="kernel", interpret=params).interpret is params


@pytest.mark.parametrize(
    "resolve, match",
    [
        (dict(platform=3), "platform=3 must be a str"),
        (dict(platform="cpu", chunk_sizes="8"), "chunk_sizes='8' must be a tuple"),
        (dict(platform="cpu", chunk_sizes=(0,)), "chunk_sizes=0 must be an int"),
    ],
)
def test_resolving_a_config_names_a_bad_platform_or_chunk(resolve, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig().resolved(**resolve)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(top_k=-1.0), r"top_k=-1\.0 must be an int"),
        (dict(top_k=-2), "top_k=-2 must be an int"),
        (dict(stop_token_ids={1: 2}), r"stop_token_ids=\{1: 2\} must be a sequence"),
        (dict(stop_token_ids=[True]), "stop_token_ids=True must be an int"),
    ],
)
def test_sampling_params_name_a_bad_option(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**options)
    assert SamplingParams(top_k=np.int64(-1)).top_k == 0


@pytest.mark.parametrize("request_id", [["a"], {"a": 1}])
def test_add_request_names_an_unhashable_request_id_before_reading_the_engine(request_id):
    """Checked before anything of the engine is read: an engine without a model stands in for one."""
    with pytest.raises(TypeError, match=r"request_id=.* must be hashable"):
        Engine.add_request(Engine.__new__(Engine), [1, 2], request_id=request_id)


def test_an_id_given_by_the_caller_is_never_given_again_to_a_request_without_one():
    """Requests without an id get their arrival index, or the next integer no request holds."""
    from types import SimpleNamespace

    from jax_hybrid_attn.engine.scheduler import Scheduler

    allocator = SimpleNamespace(enable_caching=False, block_sizes=(), kinds=())
    scheduler = Scheduler(EngineConfig(), max_model_len=64, manager=SimpleNamespace(config=allocator),
                          on_device=None, eos_token_ids=frozenset())  # fmt: skip
    sampling = SamplingParams()
    assert scheduler.add([1], sampling, request_id=1) == 1  # arrival index 0
    assert scheduler.add([1], sampling) == 2  # arrival index 1, which the caller's request holds
    assert scheduler.add([1], sampling) == 3
    assert scheduler.add([1], sampling, request_id="x") == "x"
    assert scheduler.add([1], sampling) == 4
    with pytest.raises(ValueError, match="request_id=3 is already in the engine"):
        scheduler.add([1], sampling, request_id=3)
