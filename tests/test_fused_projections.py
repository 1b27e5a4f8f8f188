"""Fused projections for serving: each layer's q/k/v projections as one Linear, and a dense MLP's gate/up as one
(`DecoderLayer.fuse_projections`), laid out for scans by `ScannedDecoder.from_decoder(..., fuse_projections=True)`.
Every family computes the logits of its unfused layers, the decoder is left as it was, abstract models fuse to the
same shapes, and an engine gives the same greedy tokens fused or not."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_hybrid_attn.engine import Engine, EngineConfig, SamplingParams
from jax_hybrid_attn.engine import step_cache
from jax_hybrid_attn.engine.model_runner import _stack_abstract
from jax_hybrid_attn.models import LANGUAGE_MODEL_TYPES, Decoder, DenseAttention, ModelConfig
from jax_hybrid_attn.models.layer_scan import ScannedDecoder
from jax_hybrid_attn.models.layers import GatedMLP, Linear, concatenate_weights

from .hf_families import FAMILIES  # skips the module without transformers and torch
from .test_engine import PROMPTS, dense_greedy, perturbed_decoder, tiny_model

NUM_TOKENS = 19


def _family_model(family: str, seed: int = 0) -> tuple[ModelConfig, Decoder]:
    """`family`'s tiny model of `hf_families`, every parameter perturbed, float32."""
    config = ModelConfig.from_hf(FAMILIES[family][0]().to_dict())
    return config, perturbed_decoder(config, seed)


@jax.jit
def _scanned_logits(scanned: ScannedDecoder, tokens):
    logits, _ = scanned(tokens, DenseAttention(tokens.shape[0]))
    return logits


def _paths(state: nnx.State) -> set[str]:
    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}


@pytest.mark.parametrize("family", LANGUAGE_MODEL_TYPES)
def test_fused_layers_give_the_unfused_logits(family):
    """Every language model family (gpt_oss with attention biases, qwen3_moe and llama4_text with MoE and dense
    layers): the scanned decoder of fused layers gives the logits of the unfused one."""
    config, model = _family_model(family)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, NUM_TOKENS), jnp.int32)
    want = np.asarray(_scanned_logits(ScannedDecoder.from_decoder(model), tokens))
    got = np.asarray(_scanned_logits(ScannedDecoder.from_decoder(model, fuse_projections=True), tokens))
    scale = float(np.abs(want).max())
    assert scale > 0.1, scale
    assert float(np.abs(got - want).max()) <= 1e-5 * scale
    eager, _ = model(tokens, DenseAttention(NUM_TOKENS))  # and what the decoder computes
    np.testing.assert_allclose(got, eager, rtol=2e-5, atol=2e-5 * scale)


def test_a_scanned_layer_runs_one_matmul_for_q_k_v_and_one_for_gate_up():
    """Mistral's two layers, one scan: its body has three matmuls fewer fused (q/k/v one, gate/up one)."""
    config, model = _family_model("mistral")
    tokens = jnp.zeros(NUM_TOKENS, jnp.int32)
    dots = {fuse: _scanned_logits.lower(ScannedDecoder.from_decoder(model, fuse_projections=fuse), tokens).as_text()
            .count("stablehlo.dot_general") for fuse in (True, False)}  # fmt: skip
    assert dots[False] - dots[True] == 3, dots


def test_a_fused_layer_holds_the_concatenated_weights_and_computes_the_same():
    """gpt-oss's biased q/k/v, Llama 4's dense layer (its gate/up fused) and MoE layer (its experts as they were,
    its shared expert too): the fused Linears hold the unfused weights, q's rows first, and the layer's output is
    the unfused one's."""
    for family, layer_index in (("gpt_oss", 0), ("llama4_text", 0), ("llama4_text", 1)):
        config, model = _family_model(family, seed=3)
        layer = model.model.layers[layer_index]
        fused = nnx.merge(*nnx.split(layer))
        fused.fuse_projections()
        attention = layer.self_attn
        qkv = fused.self_attn.qkv_proj
        assert fused.self_attn.q_proj is fused.self_attn.k_proj is fused.self_attn.v_proj is None
        np.testing.assert_array_equal(qkv.weight[...], jnp.concatenate(
            [attention.q_proj.weight[...], attention.k_proj.weight[...], attention.v_proj.weight[...]]))
        if config.attention_bias:
            np.testing.assert_array_equal(qkv.bias[...], jnp.concatenate(
                [attention.q_proj.bias[...], attention.k_proj.bias[...], attention.v_proj.bias[...]]))
        else:
            assert qkv.bias is None
        mlp, fused_mlp = (m.mlp if m.mlp is not None else m.feed_forward for m in (layer, fused))
        if isinstance(mlp, GatedMLP):
            assert fused_mlp.gate_proj is fused_mlp.up_proj is None
            np.testing.assert_array_equal(fused_mlp.gate_up_proj.weight[...],
                                          jnp.concatenate([mlp.gate_proj.weight[...], mlp.up_proj.weight[...]]))
        else:  # an MoE stays as it is
            assert _paths(nnx.state(fused_mlp)) == _paths(nnx.state(mlp))
        x = jax.random.normal(jax.random.key(4), (NUM_TOKENS, config.hidden_size), jnp.float32)
        want, _ = layer(x, DenseAttention(NUM_TOKENS))
        got, _ = fused(x, DenseAttention(NUM_TOKENS))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_the_decoder_is_unchanged_and_the_fused_state_has_fused_names():
    config, model = _family_model("qwen3_moe")  # experts on layers 0, 2 and 3, a dense MLP on layer 1
    graphdef, state = nnx.split(model)
    leaves = {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
    values = {path: np.asarray(leaf) for path, leaf in leaves.items()}
    scanned = ScannedDecoder.from_decoder(model, fuse_projections=True)
    after_graph, after = nnx.split(model)
    assert after_graph == graphdef
    after_leaves = dict(jax.tree_util.tree_leaves_with_path(after))
    assert after_leaves.keys() == leaves.keys()
    for path, leaf in after_leaves.items():
        assert leaf is leaves[path], path  # the same arrays, none replaced
        np.testing.assert_array_equal(leaf, values[path])
    assert "model.layers.1.self_attn.q_proj.weight" in _paths(state)
    assert "model.layers.1.mlp.gate_proj.weight" in _paths(state)

    fused_paths = [_paths(stacked) for run in scanned.layer_weights for stacked in run]
    for paths in fused_paths:
        assert {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight"} <= paths
        names = {name for path in paths for name in path.split(".")}
        assert not names & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, names
    assert sum("mlp.gate_up_proj.weight" in paths for paths in fused_paths) == 1  # the dense layer's
    unfused = [_paths(stacked) for run in ScannedDecoder.from_decoder(model).layer_weights for stacked in run]
    assert all("self_attn.q_proj.weight" in paths and "self_attn.qkv_proj.weight" not in paths for paths in unfused)


def test_an_abstract_decoder_fuses_to_the_same_shapes():
    """A model made by `nnx.eval_shape` (what a worker lowers the steps with): its fused layers' shapes and dtypes
    are the real ones', and `concatenate_weights` adds up the parts' rows."""
    config = ModelConfig.from_hf(FAMILIES["gpt_oss"][0]().to_dict())
    make = lambda: Decoder(config, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)  # noqa: E731
    shapes = lambda scanned: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), scanned.layer_weights)  # noqa: E731
    abstract = ScannedDecoder.from_decoder(nnx.eval_shape(make), stack=_stack_abstract, fuse_projections=True)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(abstract.layer_weights))
    assert shapes(abstract) == shapes(ScannedDecoder.from_decoder(make(), fuse_projections=True))
    parts = [jax.ShapeDtypeStruct((n, 8), jnp.bfloat16) for n in (4, 2, 2)]
    assert concatenate_weights(parts) == jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="concatenate"):
        concatenate_weights([jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4, 4), jnp.float32)])
    linear = Linear.of_weight(jnp.ones((3, 2)), None, dtype=jnp.float32)
    assert linear.bias is None and linear(jnp.ones((1, 2))).tolist() == [[2.0, 2.0, 2.0]]


def test_an_engine_gives_the_same_greedy_tokens_fused_or_not():
    """Llama 4's dense and MoE layers: the default engine serves fused layers, ``fuse_projections=False`` the
    decoder's layout, with the same greedy tokens (the dense forward's); the model passed in stays unfused."""
    config, model = tiny_model("llama4_text")
    prompts = PROMPTS[:3]
    sampling = SamplingParams(max_tokens=3, temperature=0.0)
    want = [dense_greedy(model, p, sampling.max_tokens) for p in prompts]
    sizes = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)
    for fuse in (True, False):
        engine = Engine(model, config, EngineConfig(**sizes, fuse_projections=fuse))
        assert engine.config.fuse_projections is fuse
        paths = _paths(engine.runner.model.layer_weights[0][0])
        assert ("self_attn.qkv_proj.weight" in paths) is fuse and ("self_attn.q_proj.weight" in paths) is not fuse
        assert [o.output_token_ids for o in engine.generate(prompts, sampling)] == want
    assert model.model.layers[0].self_attn.qkv_proj is None and model.model.layers[0].self_attn.q_proj is not None


def test_fuse_projections_is_a_bool_and_keys_the_step_cache():
    assert EngineConfig().fuse_projections is True
    with pytest.raises(ValueError, match="fuse_projections"):
        EngineConfig(fuse_projections="yes")
    config, _ = tiny_model("mistral")
    engine_config = EngineConfig(max_model_len=32).resolved(platform="cpu")
    fingerprints = {
        fuse: step_cache.RunnerSpec.of_config(config, dataclasses.replace(engine_config, fuse_projections=fuse), 32,
                                              dtype=jnp.float32, param_dtype=jnp.float32)  # fmt: skip
        .fingerprint(("forward", None), platform="cpu", device_kind="cpu")
        for fuse in (True, False)
    }
    assert fingerprints[True] != fingerprints[False]
