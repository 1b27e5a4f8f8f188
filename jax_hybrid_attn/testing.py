"""Random paged-attention inputs for tests, benchmarks, notebooks and the demo.

Blocks are scattered through the pool by a random permutation; every block no request uses, the null
block included, is filled with NaN (and so is the unwritten tail of each request's last block), so a
kernel that reads where it should not produces NaN.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from .constants import NULL_BLOCK_ID
from .integers import cdiv
from .layout import FP8_DTYPE, KVCache, KVLayout, get_kv_cache_shape
from .masks import allowed_key_range
from .metadata import AttentionMetadata, make_attention_metadata
from .params import LayerAttentionParams

__all__ = ["PagedInputs", "TOLERANCES", "device_dependent_control_flow", "random_paged_inputs", "pack_paged_inputs"]

TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.float16): dict(atol=4e-3, rtol=4e-3),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
}
"""Output tolerances against a float64 computation, keyed by the output (query) dtype."""


@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """Inputs of `paged_attention` plus each request's K/V in contiguous form (float64, dequantized)."""

    q: jax.Array  # [T, N, H]
    kv_cache: KVCache  # its layout and dtype as asked; a float8 cache with its scales
    metadata: AttentionMetadata
    sinks: jax.Array | None  # [N]
    keys: list[np.ndarray]  # per request [seq_len, K, H]
    values: list[np.ndarray]  # per request [seq_len, K, H]


def random_paged_inputs(
    seed: int,
    *,
    query_lens,
    seq_lens,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=jnp.bfloat16,
    kv_dtype=None,
    kv_layout: KVLayout = "NHD",
    spare_blocks: int = 2,
    with_sinks: bool = False,
    causal: bool = True,
    null_unreachable_for: dict | None = None,
    kv_pair: bool = False,
    shared_prefix_len: int = 0,
) -> PagedInputs:
    """Random q, cache and metadata for requests with the given query and sequence lengths.

    Args:
      kv_dtype: cache dtype; default `dtype`; float8_e4m3fn gets random per-tensor scales.
      kv_pair: the cache as the pair (k_cache, v_cache) of two arrays instead of one.
      spare_blocks: extra unused (NaN) blocks in the pool besides the null block.
      null_unreachable_for: ``dict(sliding_window=..., attention_chunk_size=...)``: blocks that no query
        of the request can attend to are replaced by `NULL_BLOCK_ID`, as the hybrid allocator does.
      shared_prefix_len: every request's first this many keys and values are the first request's, and the
        blocks they fill are the first request's blocks (a prefix cached once, as prefix caching shares it).
    """
    rng = np.random.default_rng(seed)
    query_lens = np.asarray(query_lens, np.int64)
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    fp8 = kv_dtype == FP8_DTYPE
    k_scale, v_scale = (float(rng.uniform(0.02, 0.05)), float(rng.uniform(0.02, 0.05))) if fp8 else (None, None)
    keys, values = [], []
    for seq_len in seq_lens:
        kv = rng.standard_normal((2, int(seq_len), num_kv_heads, head_dim))
        if fp8:  # values of a few scales' size, so the e4m3 grid is used well
            kv = kv * 8 * np.array([k_scale, v_scale])[:, None, None, None]
        keys.append(kv[0])
        values.append(kv[1])
    if shared_prefix_len > min(map(int, seq_lens)):
        raise ValueError(f"{shared_prefix_len=} is longer than a request's seq_lens={list(map(int, seq_lens))}")
    for k, v in zip(keys[1:], values[1:]):
        k[:shared_prefix_len], v[:shared_prefix_len] = keys[0][:shared_prefix_len], values[0][:shared_prefix_len]
    q = rng.standard_normal((int(query_lens.sum()), num_q_heads, head_dim))
    sinks = rng.uniform(-1.0, 3.0, num_q_heads) if with_sinks else None
    return pack_paged_inputs(
        rng, q, keys, values, query_lens,
        block_size=block_size, dtype=dtype, kv_dtype=kv_dtype, kv_layout=kv_layout, k_scale=k_scale,
        v_scale=v_scale, spare_blocks=spare_blocks, sinks=sinks, causal=causal,
        null_unreachable_for=null_unreachable_for, kv_pair=kv_pair, shared_blocks=shared_prefix_len // block_size,
    )  # fmt: skip


def pack_paged_inputs(
    rng: np.random.Generator,
    q: np.ndarray,
    keys: list[np.ndarray],
    values: list[np.ndarray],
    query_lens,
    *,
    block_size: int,
    dtype=jnp.bfloat16,
    kv_dtype=None,
    kv_layout: KVLayout = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
    spare_blocks: int = 2,
    sinks: np.ndarray | None = None,
    causal: bool = True,
    null_unreachable_for: dict | None = None,
    kv_pair: bool = False,
    shared_blocks: int = 0,
) -> PagedInputs:
    """Store given per-request K/V ([seq_len, K, H] each) in randomly placed blocks of a NaN-filled pool; the
    first `shared_blocks` entries of every block table are the first request's (their K/V must be equal), and
    the blocks they replace stay NaN."""
    query_lens = np.asarray(query_lens, np.int64)
    seq_lens = np.array([len(k) for k in keys], np.int64)
    num_kv_heads, head_dim = keys[0].shape[1:]
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    blocks_per_request = cdiv(seq_lens, block_size)
    max_blocks = max(int(blocks_per_request.max(initial=0)), 1)
    num_blocks = 1 + int(blocks_per_request.sum()) + spare_blocks
    pool_ids = rng.permutation(np.arange(1, num_blocks))
    block_tables = np.full((len(seq_lens), max_blocks), NULL_BLOCK_ID, np.int64)
    block_tables[np.arange(max_blocks)[None, :] < blocks_per_request[:, None]] = pool_ids[: blocks_per_request.sum()]
    block_tables[:, :shared_blocks] = block_tables[:1, :shared_blocks]

    fp8 = kv_dtype == FP8_DTYPE
    scales = np.array([k_scale, v_scale] if fp8 else [1.0, 1.0])[:, None, None, None]
    nhd = np.full((num_blocks, 2, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    stored_keys, stored_values = [], []
    for r, (k, v) in enumerate(zip(keys, values)):
        stored = (np.stack([k, v]) / scales).astype(kv_dtype)
        positions = np.arange(len(k))
        nhd[block_tables[r, positions // block_size], :, positions % block_size] = np.moveaxis(stored, 0, 1)
        dequantized = stored.astype(np.float64) * scales
        stored_keys.append(dequantized[0])
        stored_values.append(dequantized[1])

    if null_unreachable_for:
        params = LayerAttentionParams(causal=causal, **null_unreachable_for)
        first_key, _ = allowed_key_range(jnp.asarray(seq_lens - query_lens), jnp.asarray(seq_lens), params=params)
        unreachable = np.arange(max_blocks)[None, :] < (np.asarray(first_key) // block_size)[:, None]
        block_tables[unreachable & (query_lens > 0)[:, None]] = NULL_BLOCK_ID

    arrays = jnp.asarray(nhd).astype(kv_dtype)
    if kv_layout != "NHD":
        arrays = jnp.swapaxes(arrays, 2, 3)
    if kv_layout == "HND_VT":  # V transposed per block and head, in the same shape
        v_t = jnp.swapaxes(arrays[:, 1], 2, 3)
        arrays = arrays.at[:, 1].set(v_t.reshape(arrays.shape[0], *arrays.shape[2:]))
    assert arrays.shape == get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, kv_layout=kv_layout)
    if kv_pair:
        arrays = (arrays[:, 0], arrays[:, 1])
    metadata = make_attention_metadata(query_lens, seq_lens, block_tables, block_size=block_size, causal=causal)
    return PagedInputs(
        q=jnp.asarray(q, dtype),
        kv_cache=KVCache(arrays, kv_layout, k_scale, v_scale),
        metadata=metadata,
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
        keys=stored_keys,
        values=stored_values,
    )


def device_dependent_control_flow(jaxpr: jax.extend.core.Jaxpr) -> list[str]:
    """The `while` loops and `cond`s that a GPU runs in `jaxpr` (sub-jaxprs included), each as its primitive's name
    and where it was traced. On a GPU, XLA reads such a loop's or branch's predicate back to the host before it
    launches what follows, so the call cannot return before the device got there. Loops with a trip count known
    when tracing are `scan`s, not listed. Of a platform selection (`lax.platform_dependent` without a CUDA
    branch) only its default branch, the last, counts."""
    found, platform_indices = [], set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "platform_index":
            if any("cuda" in (names or ()) for names in eqn.params["platforms"]):
                raise NotImplementedError(f"a platform selection with a CUDA branch: {eqn.params['platforms']}")
            platform_indices.update(map(id, eqn.outvars))
        selection = eqn.primitive.name == "cond" and id(eqn.invars[0]) in platform_indices
        if eqn.primitive.name == "while" or (eqn.primitive.name == "cond" and not selection):
            found.append(f"{eqn.primitive.name}: {eqn.source_info.traceback}")
        for name, param in eqn.params.items():
            if selection and name == "branches":
                param = param[-1:]
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    found += device_dependent_control_flow(sub)
    return found
