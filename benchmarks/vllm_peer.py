"""vLLM 0.33's Python `KVCacheManager` as the peer of our allocator, for the side-by-side benchmarks.

`vllm_kv_cache_manager` builds vLLM's manager for the groups and pool of an `AllocatorConfig` (one KV-cache group per
spec, in group order, as vLLM groups a model's layers); `request_factory` makes vLLM `Request` objects whose block
hashes are kept up to date as tokens are appended (vLLM's block hasher, sha256). Only our public API is used.

Import this module before torch: it sets one torch thread, as vLLM's engine runs for serving
(`vllm.utils.torch_utils.set_torch_threads_for_runtime`), or torch's idle OpenMP threads spin and take cycles from
whatever runs beside them.
"""

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from jax_hybrid_attn import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = ["request_factory", "vllm_kv_cache_manager", "vllm_spec"]


def vllm_spec(spec):
    """vLLM's spec for one of ours (the dtype does not matter to the allocator: vLLM's pages are all bf16 here)."""
    import torch
    from vllm.v1 import kv_cache_interface as vllm_specs

    layer = {"block_size": spec.block_size, "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size}
    layer["dtype"] = torch.bfloat16
    if isinstance(spec, SlidingWindowSpec):
        return vllm_specs.SlidingWindowSpec(**layer, sliding_window=spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return vllm_specs.ChunkedLocalAttentionSpec(**layer, attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, FullAttentionSpec):
        return vllm_specs.FullAttentionSpec(**layer)
    raise NotImplementedError(f"no vLLM peer for {type(spec).__name__}")


def vllm_kv_cache_manager(config):
    """vLLM's `KVCacheManager` with `config`'s groups, pool, `max_model_len` and prefix caching, as vLLM's scheduler
    builds it for a synchronous engine (``max_in_flight_tokens`` = one batch: ``max_num_batched_tokens``, which
    sizes the admission cap of window and chunk groups as our `AllocatorConfig` does; no watermark)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer{g}"], vllm_spec(spec)) for g, spec in enumerate(config.specs)]
    block_sizes = [
        spec.block_size for spec in config.specs
    ]  # hybrid: hits aligned to the lcm, hashed at the gcd
    return KVCacheManager(
        KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups),
        max_model_len=config.max_model_len,
        max_in_flight_tokens=config.max_num_batched_tokens + config.max_num_lookahead_tokens,
        scheduler_block_size=math.lcm(*block_sizes),
        hash_block_size=math.gcd(*block_sizes),
        enable_caching=config.enable_caching,
    )


def request_factory(hash_block_size: int):
    """``make(request_id, token_ids, max_tokens=2**20)``: a vLLM `Request` hashed by vLLM's block hasher (sha256;
    `append_output_token_ids` hashes each block as it fills)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(hash_block_size, sha256)

    def make(request_id: str, token_ids, max_tokens: int = 1 << 20):
        return Request(
            request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher
        )

    return make
