"""KV-cache specs (vLLM's formulas) and per-layer parameters."""

import dataclasses
import math

import jax.numpy as jnp
import pytest

from jax_hybrid_attn import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerAttentionParams,
    SlidingWindowSpec,
    metadata_group_key,
)

COMMON = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16)
PAGE = 2 * 16 * 8 * 128 * 2


def test_page_size_bytes():
    assert FullAttentionSpec(**COMMON).page_size_bytes == PAGE
    assert FullAttentionSpec(**{**COMMON, "dtype": jnp.float8_e4m3fn}).page_size_bytes == PAGE // 2


@pytest.mark.parametrize(("max_model_len", "batched"), [(32768, 8192), (1000, 8192), (100_000, 2048)])
def test_max_memory_usage_bytes(max_model_len, batched):
    sizes = dict(max_model_len=max_model_len, max_num_batched_tokens=batched)
    assert FullAttentionSpec(**COMMON).max_memory_usage_bytes(**sizes) == math.ceil(max_model_len / 16) * PAGE
    window = SlidingWindowSpec(**COMMON, sliding_window=1024)
    expected_window_blocks = math.ceil(min(1023 + batched, max_model_len) / 16) + 1
    assert window.max_memory_usage_bytes(**sizes) == expected_window_blocks * PAGE
    chunked = ChunkedLocalAttentionSpec(**COMMON, attention_chunk_size=8192)
    assert chunked.max_memory_usage_bytes(**sizes) == math.ceil(min(8192 + batched, max_model_len) / 16) * PAGE


def test_specs_are_frozen_hashable_and_compare_by_value():
    a, b = SlidingWindowSpec(**COMMON, sliding_window=512), SlidingWindowSpec(**COMMON, sliding_window=512)
    assert a == b and hash(a) == hash(b) and len({a, b, FullAttentionSpec(**COMMON)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sliding_window = 4


def test_metadata_group_key_separates_differing_layers_without_error():
    gemma_local = LayerAttentionParams(sliding_window=1024, logits_soft_cap=50.0)
    gemma_global = LayerAttentionParams(logits_soft_cap=50.0)
    gpt_oss_local = LayerAttentionParams(sliding_window=128)
    layers = [gemma_local, gemma_global, gemma_local, gpt_oss_local, LayerAttentionParams(sliding_window=1024, logits_soft_cap=50.0)]
    keys = [metadata_group_key(p) for p in layers]
    assert keys[0] == keys[2] == keys[4]
    assert len({keys[0], keys[1], keys[3]}) == 3
    for field, value in [("sm_scale", 0.1), ("attention_chunk_size", 8192), ("causal", False)]:
        assert metadata_group_key(dataclasses.replace(gemma_global, **{field: value})) != keys[1], field
