"""The transformers attention function: tiny random models give eager's logits and greedy tokens, layer by layer.

Every model is built from a local config (no download), float32, seeded. A spy on the registered function
records each call, so a test cannot pass by falling back to another attention implementation.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax_hybrid_attn_torch import transformers_attention as hf_attention
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import (
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from jax_hybrid_attn import LayerAttentionParams
from jax_hybrid_attn.testing import TOLERANCES

NAME = hf_attention.register()
BATCH, PROMPT_LEN, NEW_TOKENS = 2, 21, 32  # the prompt straddles windows and chunks of 8
WINDOW = CHUNK = 8
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_hidden_layers=2)  # fmt: skip
SCALE = 16**-0.5


def gemma3():
    config = transformers.Gemma3TextConfig(
        **TINY,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
    )
    params = [
        LayerAttentionParams(sm_scale=24**-0.5, sliding_window=WINDOW),
        LayerAttentionParams(sm_scale=24**-0.5),
    ]
    return config, params


def gemma2():
    """The soft cap: Gemma 2 passes `softcap` (Gemma 3 does not); larger weights so that the cap bites."""
    config = transformers.Gemma2Config(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0, initializer_range=0.2,
    )  # fmt: skip
    params = [
        LayerAttentionParams(sm_scale=SCALE, sliding_window=WINDOW, logits_soft_cap=2.0),
        LayerAttentionParams(sm_scale=SCALE, logits_soft_cap=2.0),
    ]
    return config, params


def llama4():
    """Layer 0 chunked (a RoPE layer), layer 1 global (NoPE, temperature-tuned queries); a tiny MoE."""
    config = transformers.Llama4TextConfig(
        **TINY, intermediate_size_mlp=64, attention_chunk_size=CHUNK, no_rope_layers=[1, 0], num_local_experts=2,
        num_experts_per_tok=1, floor_scale=4,
    )  # fmt: skip
    assert config.layer_types == ["chunked_attention", "full_attention"]
    return config, [
        LayerAttentionParams(sm_scale=SCALE, attention_chunk_size=CHUNK),
        LayerAttentionParams(sm_scale=SCALE),
    ]


def gpt_oss():
    config = transformers.GptOssConfig(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
        num_experts_per_tok=1,
    )  # fmt: skip
    params = [
        LayerAttentionParams(sm_scale=SCALE, sliding_window=WINDOW),
        LayerAttentionParams(sm_scale=SCALE),
    ]
    return config, params


def mistral():
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    return config, [LayerAttentionParams(sm_scale=SCALE, sliding_window=WINDOW)] * 2


MODELS = {"gemma3": gemma3, "llama4": llama4, "gpt_oss": gpt_oss, "mistral": mistral, "gemma2": gemma2}


@functools.cache
def build(name: str):
    """(model on jax_hybrid, prompt, eager logits, eager greedy tokens, expected per-layer parameters)."""
    config, params = MODELS[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME, dtype=torch.float32).eval()
    assert model.config._attn_implementation == NAME
    if name == "gpt_oss":  # its init leaves the sinks at zero: make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    prompt = torch.randint(
        3, config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1)
    )
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = generate(model, prompt)
    model.set_attn_implementation(NAME)
    return model, prompt, logits, tokens, params


def generate(model, prompt):
    return model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS
    )


@pytest.fixture
def calls(monkeypatch):
    """Each call of the registered function: (layer index, L, S, the layer's parameters)."""
    record = []
    registered = AttentionInterface._global_mapping[NAME]
    assert registered is hf_attention.attention_forward

    def spy(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        params = hf_attention.layer_params(module, scaling, **kwargs)
        record.append((module.layer_idx, query.shape[2], key.shape[2], params))
        return registered(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    monkeypatch.setitem(AttentionInterface._global_mapping, NAME, spy)
    return record


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager(name, calls):
    model, prompt, eager_logits, _, params = build(name)
    with torch.no_grad():
        logits = model(prompt).logits
    np.testing.assert_allclose(logits.numpy(), eager_logits.numpy(), **TOLERANCES[jnp.dtype(jnp.float32)])
    assert calls == [(i, PROMPT_LEN, PROMPT_LEN, p) for i, p in enumerate(params)], (
        "each layer, its own parameters"
    )


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_eager(name, calls):
    model, prompt, _, eager_tokens, params = build(name)
    with torch.no_grad():
        tokens = generate(model, prompt)
    assert tokens.shape == (BATCH, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(tokens, eager_tokens)

    num_layers = len(params)
    assert len(calls) == NEW_TOKENS * num_layers, (
        "a prefill and NEW_TOKENS - 1 decode steps, every layer each time"
    )
    for step in range(NEW_TOKENS):
        step_calls = calls[step * num_layers : (step + 1) * num_layers]
        assert [c[0] for c in step_calls] == list(range(num_layers))
        assert [c[3] for c in step_calls] == params
        for _, q_len, kv_len, layer in step_calls:
            assert q_len == (PROMPT_LEN if step == 0 else 1)
            context = PROMPT_LEN + step
            local = layer.sliding_window or layer.attention_chunk_size
            # HF's window/chunk caches keep the last W - 1 (or C - 1) keys besides the step's queries.
            assert kv_len == (context if local is None or step == 0 else min(context, local - 1 + q_len))


def test_inference_mode():
    """Inference tensors have no version counter (the mask check's cache copes)."""
    model, prompt, eager_logits, *_ = build("mistral")
    with torch.inference_mode():
        logits = model(prompt).logits
    np.testing.assert_allclose(logits.numpy(), eager_logits.numpy(), **TOLERANCES[jnp.dtype(jnp.float32)])


def test_chunked_layers_see_a_moving_key_offset(calls):
    """Llama 4's chunked cache hands over the last C - 1 keys: every offset mod C occurs while generating."""
    model, prompt, *_ = build("llama4")
    seen = []
    original = hf_attention._key_offset

    def record(mask, params, q_len, kv_len):
        offset = original(mask, params, q_len, kv_len)
        if params.attention_chunk_size:
            seen.append(offset)
        return offset

    hf_attention._checked_masks.clear()
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(hf_attention, "_key_offset", record)
        generate(model, prompt)
    assert set(seen) == set(range(CHUNK))


@pytest.mark.parametrize("name", ["mistral", "llama4"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_raises(name, side, calls):
    model, prompt, *_ = build(name)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :3] = 0 if side == "left" else 1
    attention_mask[1, -3:] = 0 if side == "right" else 1
    with torch.no_grad(), pytest.raises(NotImplementedError, match="jax_hybrid"):
        model(prompt, attention_mask=attention_mask)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="padded"):
        model.generate(prompt, attention_mask=attention_mask, do_sample=False, max_new_tokens=2)
    assert calls, "the error came from the registered function"


def test_training_raises():
    model, prompt, *_ = build("mistral")
    with pytest.raises(NotImplementedError, match="no backward"):
        model(prompt)  # gradients enabled: no silent detach
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    try:
        with torch.no_grad(), pytest.raises(NotImplementedError, match="dropout"):
            model(prompt)
    finally:
        model.eval()
        model.config.attention_dropout = 0.0
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.0


def hf_mask(mask_function, q_len, kv_len, kv_offset=0):
    """HF's own boolean mask for `kv_len` keys from `kv_offset` whose last `q_len` are the queries."""
    return sdpa_mask(
        batch_size=1, q_length=q_len, kv_length=kv_len, q_offset=kv_offset + kv_len - q_len, kv_offset=kv_offset,
        mask_function=mask_function, allow_is_causal_skip=False,
    )  # fmt: skip


@pytest.mark.parametrize("window", [1, 3, 8])
def test_hf_sliding_window_is_our_window(window):
    """HF keeps ``kv_idx > q_idx - W``: the W most recent positions including the query, as params.py says."""
    mask = hf_mask(sliding_window_causal_mask_function(window), PROMPT_LEN, PROMPT_LEN)
    assert (
        hf_attention._key_offset(mask, LayerAttentionParams(sliding_window=window), PROMPT_LEN, PROMPT_LEN)
        == 0
    )
    for wrong in (window - 1 or None, window + 1):
        with pytest.raises(NotImplementedError, match="differs from the pattern"):
            hf_attention._key_offset(mask, LayerAttentionParams(sliding_window=wrong), PROMPT_LEN, PROMPT_LEN)


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("kv_offset", range(0, 2 * CHUNK + 1, 3))
def test_hf_chunks_are_our_chunks_at_any_key_offset(q_len, kv_offset):
    """HF's chunked mask on absolute positions; the keys start at `kv_offset` (its cache dropped the rest)."""
    kv_len = CHUNK - 1 + q_len
    chunked = chunked_causal_mask_function(CHUNK, torch.zeros(1, dtype=torch.long))
    mask = hf_mask(chunked, q_len, kv_len, kv_offset)
    params = LayerAttentionParams(attention_chunk_size=CHUNK)
    assert hf_attention._key_offset(mask, params, q_len, kv_len) == kv_offset % CHUNK
    if (
        kv_offset % CHUNK or q_len > 1
    ):  # some query's chunk starts after the first key: a global layer differs
        with pytest.raises(NotImplementedError, match="differs from the pattern"):
            hf_attention._key_offset(mask, LayerAttentionParams(), q_len, kv_len)


def test_tensors_of_another_rank_are_named():
    query, kv = torch.zeros(2, 4, 8), torch.zeros(1, 2, 4, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"query must be a 4-D torch.Tensor .*, got shape \(2, 4"):
        hf_attention.attention_forward(torch.nn.Module(), query, kv, kv, None)


def test_masks_hf_never_builds_are_refused():
    causal = hf_mask(causal_mask_function, 4, 4)
    with pytest.raises(NotImplementedError, match="bias"):
        hf_attention._key_offset(torch.where(causal, 0.5, -torch.inf), LayerAttentionParams(), 4, 4)
    with pytest.raises(NotImplementedError, match="shape"):
        hf_attention._key_offset(causal, LayerAttentionParams(), 4, 5)
    with pytest.raises(NotImplementedError, match="allows keys"):
        hf_attention._key_offset(torch.ones_like(causal), LayerAttentionParams(), 4, 4)
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    assert hf_attention._key_offset(additive, LayerAttentionParams(), 4, 4) == 0
