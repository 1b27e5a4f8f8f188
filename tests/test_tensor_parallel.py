"""The model split over 2 and 8 devices (8 forced CPU devices): for every layer pattern that splits differently,
the model's logits equal one device's within float32 tolerance, and the engine's greedy tokens on 2 devices (for the
windowed pattern: the chunked one's split attention is the same, and the sinks' split is tests/test_sharding.py's)
are identical to one device's (the dense forward's greedy tokens, which the engine gives on one device:
tests/test_engine.py). 8 query and 2 KV heads: on 8 devices the
KV heads are replicated; the engine with replicated KV heads is the command's test (1 KV head on 2 devices).

XLA's forced host device count must be set before JAX starts, so each family runs in a subprocess; and two
processes on one host run one engine through `jax.distributed`.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from .forced_devices import forced_cpu_devices_env

CHECK = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams
    from jax_hybrid_attn.sharding import TENSOR_AXIS
    from jax_hybrid_attn.models import DenseAttention, ModelConfig
    from jax_hybrid_attn.models.partitioning import shard_model
    from jax_hybrid_attn.testing import TOLERANCES
    from tests.test_engine import FAMILIES, dense_greedy, tiny_model

    assert len(jax.devices()) == 8, jax.devices()
    family = {family!r}
    hf = FAMILIES[family]()
    hf.num_attention_heads, hf.num_key_value_heads = 8, 2
    FAMILIES[family] = lambda: hf
    config, model = tiny_model(family)
    tokens = jnp.asarray([(7 * j) % 90 + 1 for j in range(20)], jnp.int32)

    def logits(graphdef, state):
        return jax.jit(lambda state: nnx.merge(graphdef, state)(tokens, DenseAttention(20))[0])(state)

    want = logits(*nnx.split(model))
    prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((13, 30, 7))]
    for tp in (2, 8):  # the KV heads split; replicated
        mesh = Mesh(np.array(jax.devices()[:tp]), (TENSOR_AXIS,))
        graphdef, state, _ = shard_model(model, mesh, TENSOR_AXIS)
        np.testing.assert_allclose(np.asarray(logits(graphdef, state)), np.asarray(want),
                                   **TOLERANCES[jnp.dtype(jnp.float32)])
    # the engine: fewer devices than KV heads (each holds one), or more (replicated)
    engine_devices = {engine_devices!r}
    # one device's greedy tokens: the dense forward's (the engine's on one device, tests/test_engine.py)
    want_tokens = [dense_greedy(model, prompt, 5) for prompt in prompts] if engine_devices else None
    per_device = []
    for tp in (1, *engine_devices):  # one device: the KV memory it holds (nothing to compile)
        engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                                    max_model_len=64, tensor_parallel=tp))
        assert len(engine.runner.kv_cache.sharding.device_set) == tp
        per_device.append(engine.layout.total_bytes // tp)
        if tp > 1:
            outputs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
            assert [o.output_token_ids for o in outputs] == want_tokens, (tp, outputs, want_tokens)
    if engine_devices:
        assert per_device[1] * 2 == per_device[0], per_device  # 2 KV heads over 2 devices: half each
    print("per-device KV bytes at TP", (1, *engine_devices), per_device)
    print("ok")
    """
)


# The layer patterns that split differently: dense MLPs with windows and q/k norms; sinks and a top-k MoE; chunked
# RoPE and global NoPE layers with a shared expert. The engine runs on 2 devices for the first (the split attention
# path is the same for chunks; the split of sinks is checked per layer in tests/test_sharding.py, the MoE's by the
# logits here); with KV heads replicated, in the command's test below.
SPLIT_PATTERNS = {"gemma3_text": (2,), "gpt_oss": (), "llama4_text": ()}


@pytest.mark.parametrize("family", list(SPLIT_PATTERNS))
def test_engine_split_over_devices_equals_one_device(family):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    check = CHECK.format(family=family, engine_devices=SPLIT_PATTERNS[family])
    result = subprocess.run([sys.executable, "-c", check], env=forced_cpu_devices_env(8), capture_output=True,
                            text=True, timeout=900, cwd=root)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# `jha generate` (what ``python -m jax_hybrid_attn generate`` runs) on 1 and then 2 of the forced devices, in one
# process: each run prints one JSON line. Small step sizes for a 6-token prompt: one decode and one mixed shape.
COMMAND = textwrap.dedent(
    """
    import sys
    from jax_hybrid_attn.cli import main

    for tp in ("1", "2"):
        code = main(["generate", "--no-progress", "--json", "--max-tokens", "4", "--prompt", "Hello", "--num-blocks",
                     "64", "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                     "--tensor-parallel", tp])
        sys.stdout.flush()
        if code:
            sys.exit(code)
    """
)


def test_the_command_splits_the_embedded_model_and_reports_kv_memory_per_device():
    env = forced_cpu_devices_env(8)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", COMMAND], env=env, capture_output=True, text=True, timeout=600,
                            cwd=root)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads(line) for line in result.stdout.splitlines())
    assert one["metrics"]["kv_cache"]["tensor_parallel"] == 1
    assert one["outputs"][0]["output_token_ids"] == two["outputs"][0]["output_token_ids"]
    kv = two["metrics"]["kv_cache"]
    # the embedded model has one KV head: each device holds it whole (replicated), as much as one device did
    assert kv["tensor_parallel"] == 2 and kv["bytes_per_device"] * 2 == kv["bytes"]
    assert kv["bytes_per_device"] == one["metrics"]["kv_cache"]["bytes"]


MULTI_PROCESS = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives between processes on a CPU
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2, jax.devices()
    from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams
    from tests.test_engine import tiny_model

    config, model = tiny_model("mistral")
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                                max_model_len=64, tensor_parallel=4))
    outputs = engine.generate({prompts!r}, SamplingParams(max_tokens=5, temperature=0.0))
    print([o.output_token_ids for o in outputs])
    """
)


def test_two_processes_run_one_engine_over_their_devices():
    """jax.distributed on one host: 2 processes of 2 CPU devices each, one mesh of 4 (KV heads repeated), every
    process adding the same requests: each reads back the tokens of one device (the dense forward's greedy tokens,
    which the engine gives on one device: tests/test_engine.py)."""
    from .test_engine import dense_greedy, tiny_model

    prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((13, 30, 7))]
    _, model = tiny_model("mistral")
    want = [dense_greedy(model, prompt, 5) for prompt in prompts]
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    env = forced_cpu_devices_env(2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = MULTI_PROCESS.format(prompts=prompts)
    processes = [
        subprocess.Popen([sys.executable, "-c", script, f"localhost:{port}", str(i)], env=env, cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for i in range(2)
    ]
    results = [process.communicate(timeout=600) for process in processes]
    for process, (out, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == want


def test_tensor_parallel_refuses_what_does_not_split():
    from jax_hybrid_attn.models import ModelConfig
    from jax_hybrid_attn.models.partitioning import tensor_parallel_config

    from .test_engine import tiny_model

    config, _ = tiny_model("mistral")  # 4 query heads, 2 KV heads
    assert tensor_parallel_config(config, 4).num_kv_heads == 4  # KV heads repeated
    with pytest.raises(ValueError, match="num_heads=4"):
        tensor_parallel_config(config, 8)
    assert isinstance(config, ModelConfig)
