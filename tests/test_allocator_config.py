"""KV-cache configuration from per-layer specs (vLLM's general hybrid path) and the allocator's static config."""

import math

import jax.numpy as jnp
import pytest

from jax_hybrid_attn import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from jax_hybrid_attn.allocator import (
    AllocatorConfig,
    blocks_per_request,
    estimate_max_model_len,
    get_kv_cache_config,
    get_kv_cache_groups,
    max_concurrency,
    unify_page_sizes,
)

LAYER = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16)
PAGE = 2 * 16 * 8 * 128 * 2
FULL = FullAttentionSpec(**LAYER)
SW = SlidingWindowSpec(**LAYER, sliding_window=1024)


def gemma3_27b_layers():
    """62 layers: five 1,024-window layers for each full layer (layers 5, 11, ... are full)."""
    return {f"layer{i}": FULL if i % 6 == 5 else SW for i in range(62)}


def test_groups_have_equal_sizes_and_strided_layers():
    groups = get_kv_cache_groups(gemma3_27b_layers())
    sizes = [len(g.layer_names) for g in groups]
    assert [g.kv_cache_spec for g in groups] == [SW] * 6 + [FULL]  # buckets in order of first appearance
    assert max(sizes) == 10  # 10 full layers: group_size = min(10, 52)
    window_layers = [f"layer{i}" for i in range(62) if i % 6 != 5]
    window_groups = [g.layer_names for g in groups if g.kv_cache_spec == SW]
    assert len(window_groups) == 6 and window_groups[0] == tuple(window_layers[0::6])
    assert sorted(sum(window_groups, ())) == sorted(window_layers)


def test_smaller_type_is_padded_when_sizes_are_close():
    """gpt-oss + EAGLE: 12 window and 13 full layers give groups of 13 (max < 1.5 * min)."""
    specs = {f"w{i}": SW for i in range(12)} | {f"f{i}": FULL for i in range(13)}
    groups = get_kv_cache_groups(specs)
    assert [len(g.layer_names) for g in groups] == [12, 13]


def test_page_sizes_are_unified_by_scaling_the_block_size():
    small = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=jnp.bfloat16)
    unified = unify_page_sizes({"a": FULL, "b": small})
    assert unified["b"].block_size == 32 and unified["b"].page_size_bytes == unified["a"].page_size_bytes
    odd = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=128, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="does not divide"):
        unify_page_sizes({"a": FULL, "b": odd})


def test_tensors_are_shared_by_one_layer_of_each_group_and_num_blocks_follows_the_budget():
    specs = {"f0": FULL, "w0": SW, "w1": SW, "f1": FULL}
    budget = 1000 * PAGE * 2 + 123
    config = get_kv_cache_config(
        specs, available_memory=budget, max_model_len=4096, max_num_batched_tokens=2048
    )
    assert config.num_blocks == 1000
    assert [t.size for t in config.kv_cache_tensors] == [1000 * PAGE] * 2
    assert [t.shared_by for t in config.kv_cache_tensors] == [("f0", "w0"), ("f1", "w1")]


def test_attention_free_model_has_only_the_null_block():
    config = get_kv_cache_config({}, available_memory=10**9, max_model_len=4096, max_num_batched_tokens=2048)
    assert config.num_blocks == 1 and config.kv_cache_groups == ()


def test_startup_check_names_the_largest_max_model_len_that_fits():
    specs = {"f": FULL, "w": SW}
    budget = 1001 * PAGE  # 1000 usable blocks after the null block
    with pytest.raises(ValueError, match=r"largest max_model_len that fits is (\d+)") as error:
        get_kv_cache_config(specs, available_memory=budget, max_model_len=32768, max_num_batched_tokens=2048)
    largest = int(error.value.args[0].split("fits is ")[1].split(";")[0])
    groups = (FULL, SW)
    sizes = dict(max_num_batched_tokens=2048)
    assert blocks_per_request(groups, max_model_len=largest, **sizes) <= 1000
    assert blocks_per_request(groups, max_model_len=largest + 1, **sizes) > 1000
    config = get_kv_cache_config(
        specs, available_memory=budget, max_model_len=largest, max_num_batched_tokens=2048
    )
    assert config.num_blocks == 1001
    assert estimate_max_model_len(groups, num_blocks=2, max_num_batched_tokens=2048, upper=100) == 0


def test_a_pool_too_small_for_one_block_says_so_once():
    message = r"needs \d+ KV-cache blocks \(.* MiB\) for one request, but only 0 are available \(0 B; .*\): no "
    with pytest.raises(ValueError, match=message) as error:
        get_kv_cache_config({"f": FULL}, available_memory=1024, max_model_len=2048, max_num_batched_tokens=512)
    assert "-1" not in str(error.value) and str(error.value).count("more memory") == 1


def test_max_concurrency():
    specs = {"f": FULL, "w": SW}
    config = get_kv_cache_config(
        specs, available_memory=10001 * PAGE, max_model_len=4096, max_num_batched_tokens=2048
    )
    per_request = math.ceil(4096 / 16) + math.ceil(min(1023 + 2048, 4096) / 16) + 1
    assert max_concurrency(config, max_model_len=4096, max_num_batched_tokens=2048) == 10000 / per_request


def test_unsupported_specs_and_bad_arguments_raise():
    class Mamba:
        pass

    with pytest.raises(NotImplementedError, match="Mamba"):
        get_kv_cache_groups({"m": Mamba()})
    with pytest.raises(ValueError, match="available_memory"):
        get_kv_cache_config({"f": FULL}, available_memory=-1, max_model_len=16, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="num_blocks"):
        AllocatorConfig(
            specs=(FULL,), num_blocks=0, max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16
        )
    with pytest.raises(ValueError, match="specs"):
        AllocatorConfig(specs=(), num_blocks=4, max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16)
    chunk = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16, attention_chunk_size=64
    )
    big_full = FullAttentionSpec(block_size=32, num_kv_heads=8, head_size=64, dtype=jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="chunked-local"):
        AllocatorConfig(
            specs=(chunk, big_full), num_blocks=4, max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16
        )


def test_allocator_config_derived_sizes():
    small = FullAttentionSpec(block_size=32, num_kv_heads=8, head_size=64, dtype=jnp.bfloat16)
    config = AllocatorConfig(
        specs=(FULL, SW, SW, small),
        num_blocks=100,
        max_num_seqs=8,
        max_model_len=1000,
        max_num_batched_tokens=64,
    )
    assert config.hash_block_size == 16 and config.alignment == 32
    assert config.blocks_per_row == (63, 63, 63, 32)
    assert config.attention_groups == ((0,), (3,), (1, 2))  # full attention first, identical specs together
    assert hash(config) == hash(
        AllocatorConfig(
            **{
                f: getattr(config, f)
                for f in ("specs", "num_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
            }
        )
    )
