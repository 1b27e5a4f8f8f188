"""The decoders against transformers: each family's tiny random checkpoint, saved with `save_pretrained` and
loaded with `load_model`, gives transformers' float32 logits (eager attention) on a 40-token prompt that
straddles its windows and chunks, and transformers' greedy tokens; bad checkpoints are refused by name.

The greedy loop recomputes the whole sequence every step with `DenseAttention`, at one padded length (the
rows after the last real token cannot reach it: every layer is causal) so that each family compiles once.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_hybrid_attn.models import (
    DenseAttention,
    ModelConfig,
    load_model,
)
from jax_hybrid_attn.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

PROMPT_LEN = 40
NEW_TOKENS = 8
VOCAB = 160


def _common(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return kw


def _mistral():
    return transformers.MistralConfig(**_common(num_hidden_layers=2, sliding_window=8, rope_theta=1000.0))


def _gemma3():
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    }
    return transformers.Gemma3TextConfig(
        **_common(
            num_hidden_layers=6,
            sliding_window=8,
            rope_parameters=rope,
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
        )
    )


def _gemma2():
    return transformers.Gemma2Config(
        **_common(
            num_hidden_layers=4,
            sliding_window=8,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            rope_theta=1000.0,
        )
    )


def _gpt_oss():
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 10_000.0,
    }
    return transformers.GptOssConfig(
        **_common(
            num_hidden_layers=2,
            intermediate_size=32,
            sliding_window=8,
            rope_parameters=rope,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )


def _llama4():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500_000.0,
    }
    return transformers.Llama4TextConfig(
        **_common(
            num_hidden_layers=4,
            intermediate_size=32,
            intermediate_size_mlp=48,
            no_rope_layer_interval=2,
            attention_chunk_size=16,
            rope_parameters=rope,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            floor_scale=8,
            attn_scale=0.5,
        )
    )


FAMILIES = {
    "mistral": (_mistral, "MistralForCausalLM"),
    "gemma3_text": (_gemma3, "Gemma3ForCausalLM"),
    "gemma2": (_gemma2, "Gemma2ForCausalLM"),
    "gpt_oss": (_gpt_oss, "GptOssForCausalLM"),
    "llama4_text": (_llama4, "Llama4ForCausalLM"),
}


def _hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with random weights, the ones init leaves constant perturbed."""
    make_config, class_name = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)._from_config(make_config(), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 1 or float(p.std()) == 0.0:  # norms, biases, sinks
                p.add_(torch.randn_like(p) * 0.3)
            if family == "gpt_oss" and name.endswith("gate_up_proj"):
                p.mul_(4.0)  # some gate/up values beyond the clamp limit (7)
    return model


def _save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return path


def _prompt(seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, size=PROMPT_LEN)


def _jitted(model):
    """The engine's way: split once, merge inside jit."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, token_ids, logits_indices):
        logits, _ = nnx.merge(graphdef, state)(
            token_ids, DenseAttention(token_ids.shape[0]), logits_indices=logits_indices
        )
        return logits

    return lambda token_ids, rows: forward(
        state, jnp.asarray(token_ids, jnp.int32), jnp.asarray(rows, jnp.int32)
    )


class _WithoutLocalLayers(DenseAttention):
    """Every layer attends to the whole prefix: no windows, no chunks (what the prompt must notice)."""

    def attend(self, layer, q, k, v, *, params, sinks=None):
        full = dataclasses.replace(params, sliding_window=None, attention_chunk_size=None)
        return super().attend(layer, q, k, v, params=full, sinks=sinks)


def _check_family(family, tmp_path):
    hf = _hf_model(family)
    config, model = load_model(_save(hf, tmp_path / family))
    assert config.architecture == family
    prompt = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor(prompt)[None]).logits[0].float().numpy()
        generated = hf.generate(
            torch.tensor(prompt)[None],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, PROMPT_LEN:].tolist()
    forward = _jitted(model)
    total = PROMPT_LEN + NEW_TOKENS
    padded = np.zeros(total, np.int64)
    padded[:PROMPT_LEN] = prompt
    ours = np.asarray(forward(padded, np.arange(PROMPT_LEN)))
    scale = float(np.abs(ref).max())
    diff = float(np.abs(ours - ref).max())
    assert scale > 1.0, scale  # the weights are large enough for the comparison to mean something
    assert diff <= 1e-4 * scale, (diff, scale)
    if any(t != "full_attention" for t in config.layer_types):  # the prompt straddles the windows / chunks
        without, _ = model(jnp.asarray(prompt), _WithoutLocalLayers(PROMPT_LEN))
        assert np.abs(np.asarray(without) - ref).max() > 1e-2 * scale
    tokens = []
    for step in range(NEW_TOKENS):
        length = PROMPT_LEN + step
        row = np.asarray(forward(padded, [length - 1]))[0]
        padded[length] = int(np.argmax(row))
        tokens.append(int(padded[length]))
    assert tokens == generated
    return config, diff, scale


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    _, diff, scale = _check_family(family, tmp_path)
    print(f"{family}: max |logit diff| {diff:.2e} (logit scale {scale:.2f})")


def test_layer_params_and_specs():
    config = ModelConfig.from_hf(_gemma3().to_dict())
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.layer_params(0).sliding_window == 8 and config.layer_params(5).sliding_window is None
    assert math.isclose(config.layer_params(0).sm_scale, 24**-0.5)
    assert config.rope[0].rope_theta == 10_000.0 and config.rope[5].rope_type == "linear"
    spec = config.kv_cache_spec(0, block_size=4, dtype=np.float32)
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 8 and spec.num_kv_heads == 2
    assert isinstance(config.kv_cache_spec(5, block_size=4, dtype=np.float32), FullAttentionSpec)
    assert isinstance(
        config.kv_cache_spec(0, block_size=4, dtype=np.float32, hybrid=False), FullAttentionSpec
    )
    llama4 = ModelConfig.from_hf(_llama4().to_dict())
    assert llama4.layer_types == ("chunked_attention", "full_attention") * 2
    assert llama4.rope[1] is None and llama4.moe_layers == (1, 3)
    spec = llama4.kv_cache_spec(0, block_size=8, dtype=np.float32)
    assert isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size == 16
    mistral = ModelConfig.from_hf({**_mistral().to_dict(), "sliding_window": None})
    assert mistral.layer_types == ("full_attention",) * 2
    with pytest.raises(ValueError, match="layer=2"):
        mistral.layer_params(2)


def test_legacy_rope_keys():
    """Hub files older than transformers 5: rope_theta / rope_scaling / rope_local_base_freq, no layer_types."""
    legacy = {k: v for k, v in _gemma3().to_dict().items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(
        rope_theta=500_000.0,
        rope_local_base_freq=20_000.0,
        sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    config = ModelConfig.from_hf(legacy)
    assert config.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert config.rope[0].rope_theta == 20_000.0 and config.rope[0].rope_type == "default"
    assert config.rope[2].rope_theta == 500_000.0 and config.rope[2].factor == 4.0
    ours = ModelConfig.from_hf(transformers.Gemma3TextConfig(**legacy).to_dict())
    assert ours == config


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("mistral")
    path = _save(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    _, model = load_model(path)
    prompt = _prompt(1)
    with torch.no_grad():
        ref = hf(torch.tensor(prompt)[None]).logits[0].numpy()
    ours, _ = model(jnp.asarray(prompt), DenseAttention(PROMPT_LEN))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4 * float(np.abs(ref).max()))


def test_bf16_checkpoint_loads(tmp_path):
    hf = _hf_model("gemma2").to(torch.bfloat16)
    config, model = load_model(_save(hf, tmp_path / "bf16"), dtype=jnp.bfloat16)
    assert model.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    logits, _ = model(jnp.asarray(_prompt()), DenseAttention(PROMPT_LEN), logits_indices=jnp.array([0, 39]))
    assert logits.shape == (2, config.vocab_size) and logits.dtype == jnp.float32
    with torch.no_grad():
        ref = hf(torch.tensor(_prompt())[None]).logits[0].float().numpy()[[0, 39]]
    assert np.abs(np.asarray(logits) - ref).max() < 0.1 * np.abs(ref).max()


# --- bad input ------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="nowhere.*not a directory"):
        load_model(tmp_path / "nowhere")


def test_no_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(NotImplementedError, match="'bert'.*gemma3_text"):
        load_model(tmp_path)


def test_missing_config_key():
    config = _mistral().to_dict()
    del config["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf(config)


def test_no_weights(tmp_path):
    _mistral().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(tmp_path)


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(tmp_path):
    path = _save(_hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks the tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(path)


def test_unexpected_tensor(tmp_path):
    path = _save(_hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        load_model(path)


def test_misshaped_tensor(tmp_path):
    path = _save(_hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.zeros(63)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\).*\(64,\)"):
        load_model(path)


# --- a second call that continues a cached prefix (positions from the cache, not from 0) ---------------


@dataclasses.dataclass(frozen=True)
class _PrefixCache:
    """Each layer's k/v of the first `start` tokens, kept by a first call; a second call's tokens sit at
    positions start.. and attend over the kept keys and their own (masks of `jax_hybrid_attn.masks`)."""

    start: int
    num_tokens: int
    keys: tuple = ()
    values: tuple = ()

    @property
    def positions(self):
        return jnp.arange(self.start, self.start + self.num_tokens, dtype=jnp.int32)

    def attend(self, layer, q, k, v, *, params, sinks=None):
        from jax_hybrid_attn.masks import attention_mask

        if self.start:
            k_all, v_all = jnp.concatenate([self.keys[layer], k]), jnp.concatenate([self.values[layer], v])
        else:
            k_all, v_all = k, v
        seq_len = self.start + self.num_tokens
        allowed = attention_mask(
            self.positions[:, None], jnp.arange(seq_len)[None, :], seq_len, params=params
        )
        group = q.shape[1] // k.shape[1]
        kr, vr = jnp.repeat(k_all, group, axis=1), jnp.repeat(v_all, group, axis=1)
        logits = jnp.einsum("tnh,snh->nts", q, kr, precision="highest") * params.sm_scale
        if params.logits_soft_cap is not None:
            logits = params.logits_soft_cap * jnp.tanh(logits / params.logits_soft_cap)
        logits = jnp.where(allowed[None], logits, -jnp.inf)
        if sinks is not None:
            sink = jnp.broadcast_to(sinks[:, None, None], (*logits.shape[:2], 1))
            weights = jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :-1]
        else:
            weights = jax.nn.softmax(logits, -1)
        out = jnp.einsum("nts,snh->tnh", weights, vr, precision="highest")
        written = (
            dataclasses.replace(self, keys=self.keys + (k,), values=self.values + (v,))
            if not self.start
            else self
        )
        return out, written


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "llama4_text"])
def test_continuation_uses_cache_positions(family, tmp_path):
    """The prompt's first 40 tokens in one call, the next 8 in a second call at positions 40..47: the same
    logits as transformers' 48-token forward (RoPE, Llama 4's temperature tuning and chunks from positions)."""
    hf = _hf_model(family)
    _, model = load_model(_save(hf, tmp_path / family))
    tokens = np.random.RandomState(2).randint(3, VOCAB, size=PROMPT_LEN + NEW_TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].numpy()
    _, prefix = model(
        jnp.asarray(tokens[:PROMPT_LEN]), _PrefixCache(0, PROMPT_LEN), logits_indices=jnp.array([0])
    )
    cache = _PrefixCache(PROMPT_LEN, NEW_TOKENS, prefix.keys, prefix.values)
    logits, _ = model(jnp.asarray(tokens[PROMPT_LEN:]), cache)
    scale = float(np.abs(ref).max())
    assert np.abs(np.asarray(logits) - ref[PROMPT_LEN:]).max() <= 1e-4 * scale


def test_mxfp4_experts_dequantized_as_transformers_does(tmp_path):
    """gpt-oss checkpoints store the experts as MXFP4 blocks and scales: `load_model` dequantizes them as
    transformers' `convert_moe_packed_tensors` does, and the model then gives transformers' logits."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _hf_model("gpt_oss")
    path = _save(hf, tmp_path / "mxfp4")
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n]:
        e, d_in, d_out = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 127, (e, d_out, d_in // 32), dtype=torch.uint8, generator=gen)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():  # the reference model gets transformers' dequantized weights
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales).float())
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (path / "config.json").write_text(json.dumps(config_json))
    config, model = load_model(path)
    assert config.quantization == "mxfp4"
    expected = hf.get_parameter("model.layers.1.mlp.experts.down_proj").detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.model.layers[1].mlp.experts.down_proj[...]), expected)
    prompt = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor(prompt)[None]).logits[0].numpy()
    ours, _ = model(jnp.asarray(prompt), DenseAttention(PROMPT_LEN))
    assert np.abs(np.asarray(ours) - ref).max() <= 1e-4 * float(np.abs(ref).max())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10_000.0},
        {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        # Llama 4 Scout's (high == low: no medium band) and Llama 3.1's
        {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500_000.0,
        },
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500_000.0,
        },
        # gpt-oss's, and YaRN with truncation and explicit mscale
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150_000.0,
        },
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "rope_theta": 10_000.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jax_hybrid_attn.models import RopeParameters

    hf_config = transformers.LlamaConfig(
        head_dim=64,
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=131_072,
        rope_parameters=dict(rope),
    )
    if rope["rope_type"] == "default":
        expected = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)), 1.0
    else:
        expected = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    inv_freq, scaling = RopeParameters.from_hf(rope, max_position_embeddings=131_072).inv_freq(64)
    np.testing.assert_allclose(inv_freq, expected[0].numpy(), rtol=1e-6)
    assert math.isclose(scaling, expected[1], rel_tol=1e-7)


_ALTERNATING_24 = ["sliding_attention", "full_attention"] * 12
HUB_CONFIGS = {  # config.json files as published (pre-transformers-5 keys), abridged to what the readers use
    "gemma-3-1b-it": (
        "Gemma3TextConfig",
        {
            "model_type": "gemma3_text",
            "attn_logit_softcapping": None,
            "bos_token_id": 2,
            "eos_token_id": [1, 106],
            "final_logit_softcapping": None,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "max_position_embeddings": 32768,
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "vocab_size": 262144,
        },
    ),
    "gemma-2-2b": (
        "Gemma2Config",
        {
            "model_type": "gemma2",
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "head_dim": 256,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "max_position_embeddings": 8192,
            "num_attention_heads": 8,
            "num_hidden_layers": 26,
            "num_key_value_heads": 4,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "vocab_size": 256000,
            "eos_token_id": [1, 107],
        },
    ),
    "Mistral-7B-v0.1": (
        "MistralConfig",
        {
            "model_type": "mistral",
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "vocab_size": 32000,
        },
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        {
            "model_type": "gpt_oss",
            "attention_bias": True,
            "eos_token_id": 200002,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "layer_types": _ALTERNATING_24,
            "max_position_embeddings": 131072,
            "num_attention_heads": 64,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "pad_token_id": 199999,
            "quantization_config": {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
                "quant_method": "mxfp4",
            },
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "rope_theta": 150000,
            "sliding_window": 128,
            "tie_word_embeddings": False,
            "vocab_size": 201088,
        },
    ),
    "Llama-4-Scout (text_config)": (
        "Llama4TextConfig",
        {
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 8192,
            "attn_scale": 0.1,
            "attn_temperature_tuning": True,
            "floor_scale": 8192,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "interleave_moe_layer_step": 1,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "max_position_embeddings": 10485760,
            "no_rope_layers": [],
            "num_attention_heads": 40,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 48,
            "num_key_value_heads": 8,
            "num_local_experts": 16,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 16.0,
                "high_freq_factor": 1.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "use_qk_norm": True,
            "vocab_size": 202048,
        },
    ),
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_read_as_transformers_reads_it(name):
    """A published config.json gives the same `ModelConfig` as transformers' normalized `to_dict()` of it."""
    class_name, config_json = HUB_CONFIGS[name]
    ours = ModelConfig.from_hf(config_json)
    via_transformers = ModelConfig.from_hf(getattr(transformers, class_name)(**config_json).to_dict())
    assert ours == via_transformers
    assert ours.kv_cache_spec(0, block_size=16, dtype=np.float16).num_kv_heads == ours.num_kv_heads
    if name == "Llama-4-Scout (text_config)":
        assert ours.layer_types[:4] == ("chunked_attention",) * 3 + ("full_attention",)
        assert ours.rope[3] is None and len(ours.moe_layers) == 48
