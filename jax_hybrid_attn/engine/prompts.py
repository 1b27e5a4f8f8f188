"""Which prompts an engine takes: `check_prompt`, the one check of a prompt's token ids.

`Engine.add_request` refuses what it refuses; ``jha generate`` asks it of every prompt before it loads weights or
compiles anything, so that a batch nothing of which would run fails at once.
"""

from collections.abc import Sequence

import numpy as np

from ..models.config import ModelConfig

__all__ = ["check_prompt"]


def check_prompt(
    prompt_token_ids: Sequence[int], *, model_config: ModelConfig, max_model_len: int
) -> np.ndarray:
    """`prompt_token_ids` as a flat int array, or the reason the engine refuses them:

    `ValueError` (naming the argument) for an empty or non-flat prompt, ids outside the vocabulary, or a prompt
    that leaves no room for a token within `max_model_len`; `NotImplementedError` for a prompt holding a
    multimodal wrapper's image token (`ModelConfig.image_token_id`: only text is served)."""
    tokens = np.asarray(prompt_token_ids)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"prompt_token_ids must be a non-empty flat sequence of ints, got {prompt_token_ids!r}")
    vocab = model_config.vocab_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"prompt_token_ids hold ids in [{tokens.min()}, {tokens.max()}], outside [0, {vocab=})")
    image = model_config.image_token_id
    if image is not None and bool((tokens == image).any()):
        positions = np.flatnonzero(tokens == image)
        raise NotImplementedError(
            f"prompt_token_ids hold the image token {image} (image_token_index of model_type="
            f"{model_config.model_type!r}) at positions {positions[:8].tolist()}: images are not supported, "
            "only text"
        )
    if tokens.size >= max_model_len:
        raise ValueError(
            f"the prompt's {tokens.size} tokens leave no room for output within max_model_len={max_model_len}"
        )
    return tokens
