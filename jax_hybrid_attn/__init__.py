"""jax_hybrid_attn: paged attention for models that mix full, sliding-window and chunked-local layers.

Shape letters: T query tokens · R requests · N query heads · K kv heads · H head_dim · B blocks in the
pool · S block_size · P max blocks per request. Window convention: see `jax_hybrid_attn.params`.
"""

import importlib

from . import allocator, masks, reference
from .attention import layer_attention, paged_attention
from .cascade import cascade_attention
from .constants import NULL_BLOCK_ID, PAD_SLOT_ID
from .kv_cache import write_kv
from .layout import KV_LAYOUTS, KVCache, get_kv_cache_shape
from .metadata import AttentionMetadata, make_attention_metadata, metadata_from_lengths, metadata_from_step
from .metadata_reshaping import (
    expand_block_tables,
    make_local_attention_virtual_batches,
    reorder_decodes_first,
    split_decodes_and_prefills,
)
from .params import CAUSAL, LayerAttentionParams, local_window_size, metadata_group_key, window_left
from .spec import AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from .validation import check_metadata_values

__all__ = [
    "CAUSAL",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "KV_LAYOUTS",
    "KVCache",
    "AttentionMetadata",
    "allocator",
    "cascade_attention",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "LayerAttentionParams",
    "SlidingWindowSpec",
    "check_metadata_values",
    "expand_block_tables",
    "get_kv_cache_shape",
    "local_window_size",
    "layer_attention",
    "make_attention_metadata",
    "make_local_attention_virtual_batches",
    "masks",
    "metadata_from_lengths",
    "metadata_from_step",
    "metadata_group_key",
    "paged_attention",
    "reference",
    "reorder_decodes_first",
    "split_decodes_and_prefills",
    "window_left",
    "write_kv",
]


_SUBPACKAGES = ("engine", "kernels", "models", "serve")
"""Imported on first use (``jax_hybrid_attn.models.load_model(...)`` after ``import jax_hybrid_attn``), so that
importing the package does not import the models, the engine or the server."""


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
