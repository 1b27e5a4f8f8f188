"""The embedded default model: a small Gemma-3-like hybrid decoder with random weights, so that ``jha
generate`` without ``--model`` downloads nothing. Six layers (five with a sliding window of 32, one full),
hidden size 128, 2 query heads and 1 kv head of size 64 (the smallest head the GPU kernels take), and the
`ByteTokenizer`'s vocabulary.

`save_embedded_checkpoint` writes it as a transformers checkpoint directory (transformers' Gemma3ForCausalLM
reads it too), so that every ``--model DIR`` command can be tried without a download (``jha save-embedded
DIR``).
"""

import json
import os
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from .config import ModelConfig
from .loading import random_model
from .tokenizer import ByteTokenizer

__all__ = ["EMBEDDED_CHAT_TEMPLATE", "EMBEDDED_HF_CONFIG", "embedded_config", "save_embedded_checkpoint"]

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


EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""A Gemma-style chat template for the saved embedded model (its tokens are the bytes of this text)."""

_NOT_STORED = ("self_attn.k_scale", "self_attn.v_scale")
"""Parameters a checkpoint may leave out (a float8 KV cache's scales: 1 where absent)."""


def save_embedded_checkpoint(directory: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the embedded model with random weights drawn from `seed` (float32) as a transformers checkpoint
    directory: ``config.json`` (`EMBEDDED_HF_CONFIG`), ``model.safetensors`` and ``chat_template.jinja``
    (`EMBEDDED_CHAT_TEMPLATE`); no tokenizer file, so its prompts are UTF-8 bytes as the embedded model's are. The
    directory is created; one that holds files already is refused (nothing is overwritten). Returns its path."""
    path = Path(directory)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"directory={str(directory)!r} exists and is not an empty directory")
    model = random_model(embedded_config(), seed=seed)
    tensors = {
        ".".join(map(str, name)): np.asarray(variable[...])
        for name, variable in nnx.to_flat_state(nnx.state(model))
        if not ".".join(map(str, name)).endswith(_NOT_STORED)
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})  # transformers reads "pt" files
    (path / "config.json").write_text(json.dumps({**EMBEDDED_HF_CONFIG, "dtype": "float32"}, indent=2))
    (path / "chat_template.jinja").write_text(EMBEDDED_CHAT_TEMPLATE)
    return path
