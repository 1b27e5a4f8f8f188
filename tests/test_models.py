"""The decoders against transformers: each family's tiny random checkpoint, saved with `save_pretrained` and
loaded with `load_model`, gives transformers' float32 logits (eager attention) on a 40-token prompt that
straddles its windows and chunks, and transformers' greedy tokens; bad checkpoints are refused by name.

The greedy loop recomputes the whole sequence every step with `DenseAttention`, at one padded length (the
rows after the last real token cannot reach it: every layer is causal) so that each family compiles once.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_hybrid_attn.models import (
    SUPPORTED_ARCHITECTURES,
    DenseAttention,
    ModelConfig,
    load_model,
    plan_checkpoint,
)
from jax_hybrid_attn.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

from tests.hf_families import FAMILIES, IMAGE_TOKEN, PROMPT_LEN, VOCAB, hf_greedy, hf_model
from tests.hf_families import _gemma3, _llama4, _mistral, _qwen3, _qwen3_moe
from tests.hf_families import prompt as _prompt

NEW_TOKENS = 8


def _save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return path


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

    def attend(self, layer, q, k, v, *, params, sinks=None, **kv_scales):
        full = dataclasses.replace(params, sliding_window=None, attention_chunk_size=None)
        return super().attend(layer, q, k, v, params=full, sinks=sinks, **kv_scales)


def _check_family(family, tmp_path):
    hf = hf_model(family)
    config, model = load_model(_save(hf, tmp_path / family))
    assert config.model_type == family
    prompt = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor(prompt)[None]).logits[0].float().numpy()
    generated = hf_greedy(hf, prompt, NEW_TOKENS)
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


def test_qwen3_windows_and_kv_cache_groups():
    """Qwen 3's windows from max_window_layers (as Qwen3Config derives layer_types): the allocator gets a
    sliding-window group for the sliding layers only; Qwen 3 MoE's window is on every layer, its experts where
    decoder_sparse_step and mlp_only_layers leave them."""
    from jax_hybrid_attn.engine import KVCacheLayout

    config = ModelConfig.from_hf(_qwen3().to_dict())
    assert config.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2 and config.sliding_window == 8
    assert [config.layer_params(i).sliding_window for i in range(4)] == [None, None, 8, 8]
    layout = KVCacheLayout.for_model(config, block_size=4, max_model_len=64, max_num_batched_tokens=16,
                                     dtype=np.float32)  # fmt: skip
    layers = {}
    for group in layout.kv_config.kv_cache_groups:
        layers.setdefault(type(group.kv_cache_spec), []).extend(group.layer_names)
    assert layers == {FullAttentionSpec: ["layers.0", "layers.1"], SlidingWindowSpec: ["layers.2", "layers.3"]}
    explicit = ModelConfig.from_hf({**_qwen3().to_dict(), "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert explicit.layer_types == ("sliding_attention", "full_attention") * 2
    off = ModelConfig.from_hf({**_qwen3().to_dict(), "use_sliding_window": False, "layer_types": None})
    assert off.layer_types == ("full_attention",) * 4 and off.sliding_window is None
    moe = ModelConfig.from_hf(_qwen3_moe().to_dict())
    assert moe.layer_types == ("sliding_attention",) * 4 and moe.moe_layers == (0, 2, 3)
    assert moe.expert_intermediate_size == 32 and moe.intermediate_size == 48 and moe.norm_topk_prob
    sparse = ModelConfig.from_hf({**_qwen3_moe().to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sparse.moe_layers == (1,)


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
    hf = hf_model("mistral")
    path = _save(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    _, model = load_model(path)
    prompt = _prompt(1)
    with torch.no_grad():
        ref = hf(torch.tensor(prompt)[None]).logits[0].numpy()
    ours, _ = model(jnp.asarray(prompt), DenseAttention(PROMPT_LEN))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4 * float(np.abs(ref).max()))


def test_bf16_checkpoint_loads(tmp_path):
    hf = hf_model("gemma2").to(torch.bfloat16)
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


@pytest.mark.parametrize(
    "edit, error, message",
    [
        # Qwen 3: sliding layers need a window (use_sliding_window=False drops it, as Qwen3Config does)
        (lambda c: {**c("qwen3"), "use_sliding_window": False}, ValueError, r"sliding layers \[2, 3\].*sliding_window"),
        (lambda c: {**c("qwen3"), "max_window_layers": -1, "layer_types": None}, ValueError, "max_window_layers=-1"),
        (lambda c: {**c("qwen3_moe"), "layer_types": ["full_attention"] * 4}, NotImplementedError, "layer_types"),
        (lambda c: {**c("qwen3_moe"), "decoder_sparse_step": 0}, ValueError, "decoder_sparse_step=0"),
        (lambda c: {**c("qwen3_moe"), "mlp_only_layers": [7]}, ValueError, "mlp_only_layers=7"),
        (lambda c: {**c("qwen3"), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, NotImplementedError,
         "rope_type='dynamic'"),
        # the wrappers: another language model, another wrapper, quantized weights, a text_config not a dict
        (lambda c: {**c("gemma3"), "text_config": {**c("gemma3")["text_config"], "model_type": "gemma2"}},
         NotImplementedError, "text_config.model_type='gemma2'"),
        (lambda c: {**c("gemma3"), "model_type": "llava"}, NotImplementedError, "model_type='llava'"),
        (lambda c: {**c("llama4"), "quantization_config": {"quant_method": "fbgemm_fp8"}}, NotImplementedError,
         "quant_method='fbgemm_fp8'"),
        (lambda c: {**c("llama4"), "text_config": "llama4_text"}, ValueError, "text_config='llama4_text'"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_by_name(edit, error, message):
    with pytest.raises(error, match=message):
        ModelConfig.from_hf(edit(lambda family: FAMILIES[family][0]().to_dict()))


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
    path = _save(hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks the tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(path)


def test_unexpected_tensor(tmp_path):
    path = _save(hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        load_model(path)


def test_misshaped_tensor(tmp_path):
    path = _save(hf_model("mistral"), tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.zeros(63)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\).*\(64,\)"):
        load_model(path)


# --- what is read: the plan, the wrappers' layouts, Qwen 3 MoE's per-expert and fused experts ------------

_MULTIMODAL_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")  # fmt: skip


def _counting_reads(monkeypatch) -> list[str]:
    """Every safetensors ``get_tensor`` call from now on, by tensor name."""
    import safetensors

    real, read = safetensors.safe_open, []

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self._handle = real(*args, **kwargs)

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self._handle.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._handle, name)

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    return read


def _params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family, max_shard_size", [("gemma3", "40KB"), ("llama4", None)])
def test_a_wrapper_reads_its_language_model_only(family, max_shard_size, tmp_path, monkeypatch):
    """Only the plan's tensors are read (one get_tensor each), none of the vision tower or projector; every stored
    tensor is read or skipped with a reason; the weights are transformers' language model's."""
    hf = hf_model(family)
    path = _save(hf, tmp_path / family, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert (path / "model.safetensors.index.json").is_file() == bool(max_shard_size)
    plan = plan_checkpoint(path)
    multimodal = {name for name in plan.files if name.startswith(_MULTIMODAL_PREFIXES)}
    assert multimodal and multimodal <= set(plan.skipped)
    assert set(plan.reads) | set(plan.skipped) == set(plan.files) and not set(plan.reads) & set(plan.skipped)
    read = _counting_reads(monkeypatch)
    config, model = load_model(path, plan=plan)
    assert sorted(read) == list(plan.reads) and not multimodal & set(read)
    assert config.wrapper == family and config.model_type == family and config.image_token_id == IMAGE_TOKEN
    ours = _params(model)
    for name, value in hf.state_dict().items():
        ours_name = name.replace("model.language_model.", "model.").replace("language_model.", "")
        tied = config.tie_word_embeddings and ours_name == "lm_head.weight"
        if not name.startswith(_MULTIMODAL_PREFIXES) and not tied:
            np.testing.assert_array_equal(ours.pop(ours_name), value.numpy(), err_msg=name)
    assert not ours  # every parameter is transformers' language model's


def _rename(path, rename):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})


def _transformers5_layout(name: str) -> str:
    """A wrapper's tensor name as transformers 5 holds Gemma 3 in memory (``model.language_model.*``)."""
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."), ("vision_model.", "model.vision_model."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):  # fmt: skip
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_a_wrapper_in_the_transformers_5_layout_loads_the_same_weights(family, tmp_path):
    hf = hf_model(family)
    legacy = _save(hf, tmp_path / "legacy")
    renamed = _save(hf, tmp_path / "renamed")
    _rename(renamed, _transformers5_layout)
    assert any(name.startswith("model.language_model.") for name in plan_checkpoint(renamed).reads)
    _, want = load_model(legacy)
    _, got = load_model(renamed)
    for name, value in _params(want).items():
        np.testing.assert_array_equal(_params(got)[name], value, err_msg=name)


def test_qwen3_moe_per_expert_and_fused_experts_load_alike(tmp_path):
    """transformers 5.17 saves Qwen 3 MoE's experts as one Linear per expert (as published checkpoints hold
    them): they are stacked into the fused tensors; a checkpoint of fused tensors loads the same weights."""
    from safetensors.torch import save_file

    hf = hf_model("qwen3_moe")
    per_expert = _save(hf, tmp_path / "per_expert")
    plan = plan_checkpoint(per_expert)
    source = plan.sources["model.layers.0.mlp.experts.gate_up_proj"]
    assert source.how == "experts" and source.names[:2] == (
        "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight")  # fmt: skip
    assert plan.sources["model.layers.1.mlp.up_proj.weight"].how == "copy"  # the dense layer (mlp_only_layers)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    assert plan_checkpoint(fused).sources["model.layers.0.mlp.experts.gate_up_proj"].how == "copy"
    _, a = load_model(per_expert)
    _, b = load_model(fused)
    want = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name, value in _params(a).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
        np.testing.assert_array_equal(_params(b)[name], want[name], err_msg=name)
    _rename(per_expert, lambda n: n.replace("experts.3.down_proj", "experts.3.down"))
    with pytest.raises(ValueError, match=r"lacks the tensors \['model.layers.0.mlp.experts.3.down_proj.weight'"):
        plan_checkpoint(per_expert)


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

    def attend(self, layer, q, k, v, *, params, sinks=None, k_scale=None, v_scale=None):
        from jax_hybrid_attn.masks import attention_mask

        del k_scale, v_scale  # this cache keeps K/V in their own dtype
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
    hf = hf_model(family)
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

    hf = hf_model("gpt_oss")
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
    "gemma-3-27b-it (the wrapper; its text_config leaves out vocab_size and more)": (
        "Gemma3Config",
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "boi_token_index": 255999,
            "eoi_token_index": 256000,
            "eos_token_id": [1, 106],
            "image_token_index": 262144,
            "initializer_range": 0.02,
            "mm_tokens_per_image": 256,
            "model_type": "gemma3",
            "text_config": {
                "head_dim": 128,
                "hidden_size": 5376,
                "intermediate_size": 21504,
                "model_type": "gemma3_text",
                "num_attention_heads": 32,
                "num_hidden_layers": 62,
                "num_key_value_heads": 16,
                "query_pre_attn_scalar": 168,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0",
            "vision_config": {
                "hidden_size": 1152,
                "image_size": 896,
                "intermediate_size": 4304,
                "model_type": "siglip_vision_model",
                "num_attention_heads": 16,
                "num_hidden_layers": 27,
                "patch_size": 14,
                "vision_use_head": False,
            },
        },
    ),
    "Llama-4-Scout-17B-16E-Instruct (the wrapper)": (
        "Llama4Config",
        {
            "architectures": ["Llama4ForConditionalGeneration"],
            "boi_token_index": 200080,
            "eoi_token_index": 200081,
            "image_token_index": 200092,
            "model_type": "llama4",
            "text_config": {
                "attention_bias": False,
                "attention_chunk_size": 8192,
                "attention_dropout": 0.0,
                "attn_scale": 0.1,
                "attn_temperature_tuning": 4,
                "bos_token_id": 200000,
                "cache_implementation": "hybrid",
                "eos_token_id": [200001, 200007, 200008],
                "floor_scale": 8192,
                "for_llm_compressor": False,
                "head_dim": 128,
                "hidden_act": "silu",
                "hidden_size": 5120,
                "initializer_range": 0.02,
                "interleave_moe_layer_step": 1,
                "intermediate_size": 8192,
                "intermediate_size_mlp": 16384,
                "max_position_embeddings": 10485760,
                "model_type": "llama4_text",
                "moe_layers": list(range(48)),
                "no_rope_layers": [1, 1, 1, 0] * 12,
                "num_attention_heads": 40,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 48,
                "num_key_value_heads": 8,
                "num_local_experts": 16,
                "output_router_logits": False,
                "pad_token_id": 200018,
                "rms_norm_eps": 1e-05,
                "rope_scaling": {
                    "factor": 16.0,
                    "high_freq_factor": 1.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                    "rope_type": "llama3",
                },
                "rope_theta": 500000.0,
                "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0,
                "torch_dtype": "bfloat16",
                "use_cache": True,
                "use_qk_norm": True,
                "vocab_size": 202048,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0.dev0",
            "vision_config": {
                "attention_dropout": 0.0,
                "hidden_act": "gelu",
                "hidden_size": 1408,
                "image_size": 336,
                "initializer_range": 0.02,
                "intermediate_size": 5632,
                "model_type": "llama4_vision_model",
                "multi_modal_projector_bias": False,
                "norm_eps": 1e-05,
                "num_attention_heads": 16,
                "num_channels": 3,
                "num_hidden_layers": 34,
                "patch_size": 14,
                "pixel_shuffle_ratio": 0.5,
                "projector_dropout": 0.0,
                "projector_input_dim": 4096,
                "projector_output_dim": 4096,
                "rope_theta": 10000,
                "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default",
                "vision_output_dim": 4096,
            },
        },
    ),
    "Qwen3-8B": (
        "Qwen3Config",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "max_window_layers": 36,
            "model_type": "qwen3",
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
    "Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
}


def _as_transformers_takes_it(config_json: dict) -> dict:
    """`config_json` for transformers 5.17's config classes, whose strict type checks refuse Llama 4's published
    ``attn_temperature_tuning: 4`` (an int, as transformers 4.51 wrote it): passed as the bool it means."""
    text = config_json.get("text_config")
    if isinstance(text, dict) and type(text.get("attn_temperature_tuning")) is int:
        return {**config_json, "text_config": {**text, "attn_temperature_tuning": bool(text["attn_temperature_tuning"])}}
    return config_json


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_read_as_transformers_reads_it(name):
    """A published config.json gives the same `ModelConfig` as transformers' normalized `to_dict()` of it."""
    class_name, config_json = HUB_CONFIGS[name]
    ours = ModelConfig.from_hf(config_json)
    config_class = getattr(transformers, class_name)
    assert ours == ModelConfig.from_hf(config_class(**_as_transformers_takes_it(config_json)).to_dict())
    assert ours.kv_cache_spec(0, block_size=16, dtype=np.float16).num_kv_heads == ours.num_kv_heads
    if name == "Llama-4-Scout (text_config)":
        assert ours.layer_types[:4] == ("chunked_attention",) * 3 + ("full_attention",)
        assert ours.rope[3] is None and len(ours.moe_layers) == 48
    if name.startswith("gemma-3-27b-it"):  # the text config class's sizes, the wrapper's EOS and tying
        assert (ours.model_type, ours.architecture, ours.vocab_size) == ("gemma3", "gemma3_text", 262_208)
        assert ours.layer_types.count("full_attention") == 10 and ours.layer_types[5] == "full_attention"
        assert ours.num_layers == 62 and ours.sliding_window == 1024 and ours.max_position_embeddings == 131_072
        assert ours.rope[5].rope_type == "linear" and ours.rope[5].factor == 8.0 and ours.rope[0].rope_theta == 1e4
        assert ours.eos_token_ids == (1, 106) and ours.tie_word_embeddings and ours.image_token_id == 262_144
        assert ours.final_logit_softcapping is None and math.isclose(ours.sm_scale, 168**-0.5)
    if name.startswith("Llama-4-Scout-17B-16E-Instruct"):
        assert (ours.model_type, ours.architecture, ours.attention_chunk_size) == ("llama4", "llama4_text", 8192)
        assert ours.layer_types[:4] == ("chunked_attention",) * 3 + ("full_attention",) and ours.rope[3] is None
        assert ours.eos_token_ids == (200001, 200007, 200008) and ours.image_token_id == 200_092
        assert ours.attn_temperature_tuning and not ours.tie_word_embeddings and len(ours.moe_layers) == 48
    if name == "Qwen3-8B":
        assert ours.layer_types == ("full_attention",) * 36 and ours.sliding_window is None
        assert ours.head_dim == 128 and ours.rope[0].rope_theta == 1_000_000.0
        windows_on = {**config_json, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 18}
        windowed = ModelConfig.from_hf(windows_on)
        assert windowed == ModelConfig.from_hf(transformers.Qwen3Config(**windows_on).to_dict())
        assert windowed.layer_types == ("full_attention",) * 18 + ("sliding_attention",) * 18
    if name == "Qwen3-30B-A3B":
        assert ours.moe_layers == tuple(range(48)) and (ours.num_experts, ours.num_experts_per_tok) == (128, 8)
        assert ours.expert_intermediate_size == 768 and ours.norm_topk_prob and ours.head_dim == 128


def test_the_readme_table_lists_every_supported_model_type_and_the_family_tests_cover_each():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE) == list(SUPPORTED_ARCHITECTURES)
    assert sorted(FAMILIES) == sorted(SUPPORTED_ARCHITECTURES)


def _with_kv_scales(path, scales: dict[str, object]):
    """The checkpoint at `path` with these extra tensors (name -> value) saved beside its weights."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_float8_kv_cache_scales_load_from_the_checkpoint_or_default_to_one(tmp_path):
    """vLLM's ``self_attn.k_scale`` / ``v_scale`` (shape [] or [1]) become the layers' `KVCacheScale`s, float32,
    whatever the weights' dtype; a layer without them gets 1.0; a scale that is no single finite number > 0 is
    refused, naming the tensor. The scales are no weights: the Params stay transformers' tensors."""
    from jax_hybrid_attn.models.decoder import KVCacheScale

    path = _save(hf_model("mistral"), tmp_path / "mistral")  # two layers
    _with_kv_scales(path, {"model.layers.0.self_attn.k_scale": 0.25, "model.layers.0.self_attn.v_scale": [4.0]})
    plan = plan_checkpoint(path)
    kinds = {name: source.how for name, source in plan.sources.items() if name.endswith("_scale")}
    assert kinds == {"model.layers.0.self_attn.k_scale": "kv_scale", "model.layers.0.self_attn.v_scale": "kv_scale",
                     "model.layers.1.self_attn.k_scale": "default_kv_scale",
                     "model.layers.1.self_attn.v_scale": "default_kv_scale"}  # fmt: skip
    _, model = load_model(path, dtype=jnp.bfloat16)
    scales = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, KVCacheScale))}
    assert {name: float(value) for name, value in scales.items()} == {
        "model.layers.0.self_attn.k_scale": 0.25, "model.layers.0.self_attn.v_scale": 4.0,
        "model.layers.1.self_attn.k_scale": 1.0, "model.layers.1.self_attn.v_scale": 1.0}  # fmt: skip
    assert all(value.dtype == jnp.float32 and value.shape == () for value in scales.values())
    assert not any(name.endswith("_scale") for name in _params(model))
    for bad in (0.0, -1.0, float("nan"), [1.0, 2.0]):
        _with_kv_scales(path, {"model.layers.1.self_attn.k_scale": bad})
        with pytest.raises(ValueError, match=r"tensor 'model.layers.1.self_attn.k_scale' = .* must be one finite"):
            load_model(path)
