"""Decoder models in Flax NNX whose layers take their attention type from the checkpoint's config."""

from .attention_cache import AttentionCache, DenseAttention, dense_attention

__all__ = ["AttentionCache", "DenseAttention", "dense_attention"]
