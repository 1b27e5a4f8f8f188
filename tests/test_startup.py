"""What a new process pays before it serves: the layers scanned over their pattern (compile cost independent of
depth), every step shape compiled before the first request and none after, the step functions kept across
processes, and sizes that fit the device and the model."""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import monitoring

from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams, lower_ahead
from jax_hybrid_attn.engine import step_cache
from jax_hybrid_attn.engine.step_shapes import StepShape, select_step_shape, step_shapes
from jax_hybrid_attn.kernels import mixed_batch
from jax_hybrid_attn.models import Decoder, DenseAttention, ModelConfig
from jax_hybrid_attn.models.layer_scan import LayerRun, ScannedDecoder, layer_runs

from .test_engine import dense_greedy

transformers = pytest.importorskip("transformers")

GEMMA3_PATTERN = ["sliding_attention"] * 5 + ["full_attention"]


def gemma3_config(num_layers: int) -> ModelConfig:
    layer_types = (GEMMA3_PATTERN * 5)[:num_layers]
    return ModelConfig.from_hf(transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, num_hidden_layers=num_layers, sliding_window=8,
        layer_types=layer_types, query_pre_attn_scalar=16).to_dict())  # fmt: skip


def test_layer_runs_follow_the_pattern():
    assert layer_runs((GEMMA3_PATTERN * 5)[:26]) == (LayerRun(0, 6, 4), LayerRun(24, 1, 2))
    assert layer_runs(GEMMA3_PATTERN) == (LayerRun(0, 6, 1),)
    assert layer_runs(["a"] * 32) == (LayerRun(0, 1, 32),)
    assert layer_runs(["a", "b"] * 12) == (LayerRun(0, 2, 12),)
    assert layer_runs(["a", "b", "c"]) == (LayerRun(0, 3, 1),)
    assert LayerRun(3, 2, 3).layers(1) == [4, 6, 8]


def test_the_scanned_decoder_computes_what_the_decoder_does():
    config = gemma3_config(14)  # runs: the 6-layer period twice, then 2 sliding layers
    model = Decoder(config, rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, 21), jnp.int32)
    want, _ = model(tokens, DenseAttention(21))
    scanned = jax.jit(lambda m, t: m(t, DenseAttention(21)))
    got, _ = scanned(ScannedDecoder.from_decoder(model), tokens)
    loops = scanned.lower(ScannedDecoder.from_decoder(model), tokens).as_text().count("stablehlo.while")
    assert loops == 2, loops  # each run of two repeats: a loop
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def _equations(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _equations(sub)
    return count


def test_a_step_shape_traces_about_as_much_for_26_layers_as_for_6():
    """What is traced is what is lowered and compiled: 26 Gemma-3 layers are 7 layer bodies (the 6-layer period
    and a sliding one), 6 layers are 6."""
    sizes = {}
    for num_layers in (6, 26):
        config = gemma3_config(num_layers)
        engine = Engine(Decoder(config, rngs=nnx.Rngs(0)), config,
                        EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64))  # fmt: skip
        sizes[num_layers] = [_equations(engine.runner.trace(("forward", s)).jaxpr.jaxpr) for s in engine.runner.shapes]
    assert all(deep <= 1.3 * shallow for deep, shallow in zip(sizes[26], sizes[6], strict=True)), sizes


def test_nothing_compiles_after_warm_up_over_a_long_mixed_workload():
    """New prompt lengths, chunked prefill, prefix hits, preemption (a tight pool), stop tokens, greedy and sampled
    rows, requests arriving while others decode: after `compile`, no trace and no compile."""
    config = gemma3_config(7)
    model = Decoder(config, rngs=nnx.Rngs(1))
    engine = Engine(model, config, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                                max_model_len=64, num_blocks=70, seed=5))  # fmt: skip
    engine.compile()
    events = []

    def listener(event, duration, **_):
        if event.startswith("/jax/core/compile/"):
            events.append((event, "".join(traceback.format_stack(limit=30))))

    rng = np.random.default_rng(0)
    shared = rng.integers(1, config.vocab_size, 12).tolist()
    monitoring.register_event_duration_secs_listener(listener)
    try:
        for wave in range(3):
            for i in range(5):
                length = int(rng.integers(1, 30))
                prompt = (shared if i % 2 else []) + rng.integers(1, config.vocab_size, length).tolist()
                sampling = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(i % 2) * 0.8,
                                          top_k=int(rng.integers(0, 20)), stop_token_ids=(int(rng.integers(1, 97)),))  # fmt: skip
                engine.add_request(prompt[:60], sampling)
            for _ in range(4):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        engine.synchronize()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert engine.stats.preemptions > 0 and engine.stats.cached_prompt_tokens > 0, engine.stats
    assert events == [], events[0][1]


def test_step_functions_are_lowered_by_workers_before_the_model_exists_and_kept_across_engines(tmp_path, monkeypatch):
    config = gemma3_config(3)
    sizes = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    cached = EngineConfig(**sizes, compilation_cache=str(tmp_path / "a"), compile_workers=1)
    lowering = lower_ahead(config, cached, dtype=jnp.float32)  # a worker process starts lowering now
    model = Decoder(config, rngs=nnx.Rngs(2))
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30))]
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    want = [dense_greedy(model, p, sampling.max_tokens) for p in prompts]  # the engine gives these (test_engine)

    def no_lowering(*args, **kwargs):
        raise AssertionError("a step function was lowered in this process")

    monkeypatch.setattr("jax_hybrid_attn.engine.step_cache.export_step", no_lowering)
    first = Engine(model, config, cached, lowering=lowering)
    assert first._lowering is lowering
    assert [o.output_token_ids for o in first.generate(prompts, sampling)] == want
    assert len(list((tmp_path / "a").glob("*.step"))) == len(first.runner.executable_keys())

    monkeypatch.setattr("jax_hybrid_attn.engine.step_cache.export_in_workers", no_lowering)
    second = Engine(model, config, EngineConfig(**sizes, compilation_cache=str(tmp_path / "a")))
    assert [o.output_token_ids for o in second.generate(prompts, sampling)] == want
    other = lower_ahead(config, EngineConfig(**sizes, compilation_cache=str(tmp_path / "a")), dtype=jnp.bfloat16)
    assert Engine(model, config, cached, lowering=other)._lowering is None  # another model's steps: not used


def test_a_model_the_workers_cannot_rebuild_is_lowered_here():
    config = gemma3_config(3)
    model = Decoder(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    engine_config = EngineConfig(max_model_len=32).resolved(platform="cpu")
    spec = step_cache.RunnerSpec.of(model, config, engine_config, 32)
    assert spec is not None and spec.num_sms == mixed_batch.num_sms()  # what its workers lower the kernels for
    model.model.norm.weight.set_value(model.model.norm.weight.get_value().astype(jnp.bfloat16))  # not what it rebuilds
    assert step_cache.RunnerSpec.of(model, config, engine_config, 32) is None


def test_step_shapes():
    assert step_shapes(max_num_seqs=256, max_num_batched_tokens=8192) == (
        StepShape(256, 1), *(StepShape(t, t) for t in (256, 512, 1024, 2048, 4096, 8192)))
    assert step_shapes(max_num_seqs=4, max_num_batched_tokens=48) == (StepShape(8, 1), StepShape(48, 48))
    assert step_shapes(max_num_seqs=100, max_num_batched_tokens=600) == (
        StepShape(128, 1), StepShape(256, 256), StepShape(512, 512), StepShape(600, 600))
    shapes = step_shapes(max_num_seqs=256, max_num_batched_tokens=8192)
    assert select_step_shape(shapes, 3, decode_only=True) == StepShape(256, 1)
    assert select_step_shape(shapes, 300, decode_only=False) == StepShape(512, 512)
    with pytest.raises(ValueError, match="num_tokens=9000"):
        select_step_shape(shapes, 9000, decode_only=False)


def test_sizes_fit_the_platform_and_the_block_size_the_model():
    gpu = EngineConfig().resolved(platform="gpu")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.block_size) == (256, 8192, 16)
    cpu = EngineConfig(max_num_seqs=3).resolved(platform="cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.compile_workers) == (3, 512, 0)
    assert EngineConfig().resolved(platform="cpu", chunk_sizes=(8,)).block_size == 8
    assert EngineConfig().resolved(platform="cpu", chunk_sizes=(24,)).block_size == 8
    assert EngineConfig(block_size=4).resolved(platform="cpu", chunk_sizes=(8,)).block_size == 4


def test_a_checkpoint_with_chunks_of_8_runs_with_the_default_block_size():
    config = ModelConfig.from_hf(transformers.Llama4TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_hidden_layers=2, attention_chunk_size=8,
        num_local_experts=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0]).to_dict())  # fmt: skip
    engine = Engine(Decoder(config, rngs=nnx.Rngs(0)), config, EngineConfig(max_num_seqs=2, max_model_len=32))
    assert engine.config.block_size == 8
    outputs = engine.generate([list(range(1, 20))], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(outputs[0].output_token_ids) == 3
