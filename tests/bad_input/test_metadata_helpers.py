"""Bad input to the host-side metadata helpers (`make_attention_metadata`, `expand_block_tables`,
`make_local_attention_virtual_batches`, `split_decodes_and_prefills`) and `AllocatorConfig`."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_hybrid_attn import FullAttentionSpec, write_kv
from jax_hybrid_attn.allocator import AllocatorConfig

from .cases import inputs


def test_host_metadata_helpers_refuse_negative_values():
    from jax_hybrid_attn import make_attention_metadata, make_local_attention_virtual_batches

    with pytest.raises(ValueError, match="block_tables"):
        make_attention_metadata([1], [3], [[-1]], block_size=4)
    metadata = make_attention_metadata([2], [6], [[1, 2]], block_size=4)
    with pytest.raises(ValueError, match="seq_lens"):
        make_local_attention_virtual_batches(4, metadata.replace(seq_lens=jnp.asarray([-4], jnp.int32)), 4)
    assert make_attention_metadata(np.asarray([1]), [3], [[1]], block_size=np.int64(4)).num_tokens == 1


def test_helpers_name_arguments_of_the_wrong_kind():
    """Ragged lists, tables of the wrong rank or kind, sizes as strings, something that is not metadata, a single
    spec for a sequence of them, a cache donated to an earlier call: each named, none an AttributeError or a
    TypeError from inside numpy or JAX."""
    from jax_hybrid_attn import (
        expand_block_tables, make_attention_metadata, make_local_attention_virtual_batches, split_decodes_and_prefills,
    )  # fmt: skip

    with pytest.raises(ValueError, match="block_tables must be a rectangular array of integers"):
        make_attention_metadata([1, 2], [3, 4], [[1, 2], [3]], block_size=4)
    table = jnp.asarray([[1, 2]], jnp.int32)
    for bad, match in (([[1, 2]], "got list"), (jnp.asarray([1, 2]), r"got shape \(2,\)"),
                       (table.astype(jnp.float32), "dtype=float32 must be an integer dtype")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^block_tables.*{match}"):
            expand_block_tables(bad, allocator_block_size=8, kernel_block_size=4)
    with pytest.raises(ValueError, match="allocator_block_size='8' must be an int"):
        expand_block_tables(table, allocator_block_size="8", kernel_block_size=4)
    expanded = expand_block_tables(np.asarray(table), allocator_block_size=8, kernel_block_size=4)
    assert expanded.tolist() == [[2, 3, 4, 5]]
    for call in (lambda: split_decodes_and_prefills({"query_start_loc": 0}),
                 lambda: make_local_attention_virtual_batches(8, "metadata", 4)):  # fmt: skip
        with pytest.raises(ValueError, match="metadata must be an AttentionMetadata, got"):
            call()
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32)
    for specs in (None, spec):
        with pytest.raises(ValueError, match="specs must be a sequence of AttentionSpecs"):
            AllocatorConfig(specs=specs, num_blocks=16, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8)
    x = inputs()
    k = jnp.ones((x.q.shape[0], *x.kv_cache.dims[2:]), x.q.dtype)
    write_kv(x.kv_cache, k, k, x.metadata.slot_mapping)  # donates the cache
    with pytest.raises(ValueError, match=r"kv_cache\.data was deleted: donated to an earlier call"):
        write_kv(x.kv_cache, k, k, x.metadata.slot_mapping)


def test_allocator_configuration_helpers_name_their_arguments():
    """The sizing helpers and `AllocatorConfig` refuse what is not a spec, a config or a count, naming it
    (never an AttributeError or a TypeError from inside), and store numpy ints and bools as Python values."""
    from jax_hybrid_attn.allocator import (
        blocks_per_request,
        check_enough_kv_cache_memory,
        estimate_max_model_len,
        get_kv_cache_config,
        get_kv_cache_groups,
        init_state,
        max_concurrency,
    )

    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype=jnp.float32)
    lengths = dict(max_model_len=32, max_num_batched_tokens=8)
    sized = dict(available_memory=2**16, num_blocks_override=np.int64(16), **lengths)
    kv_config = get_kv_cache_config({"a": spec}, **sized)
    assert type(kv_config.num_blocks) is int and type(kv_config.kv_cache_tensors[0].size) is int
    sizes = dict(num_blocks=np.int64(16), max_num_seqs=2, **lengths)
    config = AllocatorConfig(specs=[spec], enable_caching=np.bool_(True), **sizes)
    assert type(config.num_blocks) is int and config.enable_caching is True and config.specs == (spec,)
    for call, error, match in [
        (lambda: AllocatorConfig(specs=(spec, 3), **sizes), NotImplementedError, r"specs\[1\] is a int"),
        (lambda: AllocatorConfig.from_kv_cache_config("x", max_num_seqs=2, **lengths), ValueError, "kv_con"),
        (lambda: max_concurrency(None, **lengths), ValueError, "kv_config must be a KVCacheConfig"),
        (lambda: check_enough_kv_cache_memory({}, **lengths), ValueError, "kv_config must be a"),
        (lambda: blocks_per_request(None, **lengths), ValueError, "specs must be a sequence"),
        (lambda: blocks_per_request(["x"], **lengths), NotImplementedError, r"specs\[0\] is a str"),
        (lambda: get_kv_cache_groups({"a": None}), NotImplementedError, r"specs\['a'\] is a NoneType"),
        (lambda: estimate_max_model_len([spec], num_blocks="16", max_num_batched_tokens=8, upper=32),
         ValueError, "num_blocks='16'"),
        (lambda: estimate_max_model_len([spec], num_blocks=16, max_num_batched_tokens=8, upper=None),
         ValueError, "upper=None"),
        (lambda: init_state("config"), ValueError, "config must be an AllocatorConfig"),
    ]:
        with pytest.raises(error, match=match):
            call()
