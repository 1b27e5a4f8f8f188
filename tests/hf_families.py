"""Tiny transformers models of every supported family, seeded, for the tests that compare against transformers.

Each family's config straddles its windows and chunks with a `PROMPT_LEN`-token prompt; the multimodal wrappers
carry a tiny vision tower (its weights are saved, and must never be read) and an image token at the top of the
vocabulary, which `prompt` never draws.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LEN = 40
VOCAB = 160
IMAGE_TOKEN = VOCAB - 1
"""The wrappers' ``image_token_index`` (their begin- and end-of-image tokens are the two below it)."""
TEXT_TOKENS = VOCAB - 3
"""Prompts draw ids from [3, TEXT_TOKENS): neither pad, BOS and EOS nor the image tokens."""


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


_TINY_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14)  # fmt: skip
_IMAGE_TOKENS = dict(image_token_index=IMAGE_TOKEN, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)


def _gemma3_wrapper():
    """Gemma 3's multimodal wrapper around `_gemma3` (whose final logit soft cap the wrapper never applies)."""
    return transformers.Gemma3Config(
        text_config=_gemma3().to_dict(), vision_config=_TINY_VISION, mm_tokens_per_image=4, **_IMAGE_TOKENS
    )


def _llama4_wrapper():
    vision = dict(_TINY_VISION, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    return transformers.Llama4Config(text_config=_llama4().to_dict(), vision_config=vision, **_IMAGE_TOKENS)


def _qwen3():
    """Full layers 0-1, sliding layers 2-3 (``max_window_layers``)."""
    return transformers.Qwen3Config(
        **_common(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2,
                  rope_theta=1000.0)  # fmt: skip
    )


def _qwen3_moe():
    """A window on every layer; experts on layers 0, 2 and 3, a dense MLP on 1 (``mlp_only_layers``)."""
    return transformers.Qwen3MoeConfig(
        **_common(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True,
                  sliding_window=8, rope_theta=1000.0)  # fmt: skip
    )


FAMILIES = {
    "mistral": (_mistral, "MistralForCausalLM"),
    "gemma3_text": (_gemma3, "Gemma3ForCausalLM"),
    "gemma3": (_gemma3_wrapper, "Gemma3ForConditionalGeneration"),
    "gemma2": (_gemma2, "Gemma2ForCausalLM"),
    "gpt_oss": (_gpt_oss, "GptOssForCausalLM"),
    "llama4_text": (_llama4, "Llama4ForCausalLM"),
    "llama4": (_llama4_wrapper, "Llama4ForConditionalGeneration"),
    "qwen3": (_qwen3, "Qwen3ForCausalLM"),
    "qwen3_moe": (_qwen3_moe, "Qwen3MoeForCausalLM"),
}
"""Each supported ``model_type``: its tiny config and its transformers class."""


def hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with random weights (seeded), the ones init leaves constant perturbed."""
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


def prompt(seed: int = 0, length: int = PROMPT_LEN) -> np.ndarray:
    """`length` random text token ids."""
    return np.random.RandomState(seed).randint(3, TEXT_TOKENS, size=length)


def hf_greedy(model, prompt_ids, num_tokens: int) -> list[int]:
    """transformers' greedy tokens after `prompt_ids` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(prompt_ids))[None], max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
