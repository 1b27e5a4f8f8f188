"""The embedded default model: a small Gemma-3-like hybrid decoder with random weights, so that ``jha
generate`` without ``--model`` downloads nothing. Six layers (five with a sliding window of 32, one full),
hidden size 128, 2 query heads and 1 kv head of size 64 (the smallest head the GPU kernels take), and the
`ByteTokenizer`'s vocabulary."""

from .config import ModelConfig
from .tokenizer import ByteTokenizer

__all__ = ["EMBEDDED_HF_CONFIG", "embedded_config"]

EMBEDDED_HF_CONFIG = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": ByteTokenizer.vocab_size,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 32,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "query_pre_attn_scalar": 64,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
    "pad_token_id": ByteTokenizer.PAD,
}
"""The embedded model as a transformers ``config.json`` (a `Gemma3TextConfig` reads it too)."""


def embedded_config() -> ModelConfig:
    """The embedded model's `ModelConfig` (read from `EMBEDDED_HF_CONFIG` like any checkpoint's)."""
    return ModelConfig.from_hf(EMBEDDED_HF_CONFIG)
