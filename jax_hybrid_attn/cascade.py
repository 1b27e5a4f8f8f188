"""Cascade attention: a prefix that every request of a step shares, attended once for all of the step's queries,
and each request's own keys after it, merged by log-sum-exp (`softmax_merge`).

With prefix caching, requests behind one system prompt or document hold the same leading blocks (the allocator
reports how many per KV-cache group: `KVCacheManager.get_num_common_prefix_blocks`, as vLLM's does). Attention
then splits exactly at the prefix's end ``L = num_common_prefix_blocks * S``::

    out = merge(attention of every query over keys [0, L) of the shared blocks,
                attention of each query over its own request's keys [L, seq_len))

with the sinks entering the merged denominator once. `paged_attention` takes this path when the metadata holds
``num_common_prefix_blocks``; `cascade_attention` is the same with the count as an argument.

The split serves a request when its leading blocks are the first request's (the first with a query), its query
starts after the prefix (``seq_len - query_len >= L``), and, on a sliding-window or chunked layer with a prefix,
its keys lie inside the window or the first chunk (``seq_len <= W`` or ``<= C``): the prefix part attends without a
mask, and the suffix part's masks must not change when its positions shift by L. Other requests get NaN output,
never a wrong number (``checked=True`` raises instead; `split_violations`). A window or chunk layer gains from the
split only in that case anyway: otherwise its kernels already skip the prefix's blocks. vLLM turns cascade
attention off for sliding-window layers altogether.

On the kernels, the prefix part is one non-causal request holding every query token, over the shared blocks:
each of its query tiles (128 / G tokens) reads them once, where plain attention reads them once per request.
The reference twin computes both parts at the keys' true positions.

Shape letters as `paged_attention`: T tokens · N query heads · K KV heads · H head dim · R requests · P blocks per
request · S tokens per block.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from . import reference
from ._compat import plgpu
from .constants import NULL_BLOCK_ID
from .integers import INT32_MAX, check_int, check_int_scalar
from .kernels.mixed_batch import check_kernel_support, paged_attention_parts_kernels
from .layout import KVArrays, KVCache
from .metadata import AttentionMetadata, token_requests
from .params import CAUSAL, LayerAttentionParams, check_params
from .softmax_merge import merge_splits
from .validation import (
    check_metadata,
    check_paged_attention_args,
    resolve_implementation,
    unservable_requests,
)

# The cost rule's figures, from `benchmarks/cascade.py` on the H200 (kernel time of the whole call):
PLAIN_PREFIX_BYTES_PER_US = 6.5e6
"""Bytes per microsecond at which plain decodes read a prefix they share (mostly from L2: above HBM's rate)."""
CASCADE_FIXED_US = 20.0
"""What the split adds whatever the prefix: its extra launches, the query packing and the merge per token ..."""
CASCADE_PER_REQUEST_US = 0.1
"""... and per request."""
CASCADE_FLOPS_PER_US = 3.5e8
"""The prefix part's rate (350 TFLOP/s): all of the step's queries against the prefix, few key steps per CTA."""
CASCADE_MARGIN = 2.0
"""The split is taken only where the estimate says it saves this factor of its cost: never slower in doubt."""

__all__ = ["cascade_attention", "cascade_pays", "split_violations"]


def cascade_attention(
    q: Float[Array, "T N H"],
    kv_cache: KVCache | KVArrays,
    metadata: AttentionMetadata,
    *,
    num_common_prefix_blocks: int | Int[Array, ""],
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    checked: bool = False,
    implementation: str | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "T N H"]:
    """`paged_attention` computed as a shared prefix and per-request suffixes (arguments as there).

    Args:
      num_common_prefix_blocks: the leading entries of the block table that every request holds alike (an int,
        or an int32 scalar array, which may be traced); 0 gives plain attention. A concrete one must lie in
        ``[0, P]``; a traced one out of range breaks the split of every request with a query (NaN).
      checked: also validate the metadata's values and the split (`split_violations`); needs concrete arrays.

    Returns:
      [T, N, H] in ``q.dtype``; the tokens of a request that breaks the split are NaN.

    Raises:
      NotImplementedError: the kernels do not support this combination (named in the message).
    """
    params, kv_cache = check_paged_attention_args(q, kv_cache, metadata, params=params, sinks=sinks, checked=checked)
    _check_prefix_blocks(num_common_prefix_blocks, metadata)
    if checked:
        _, block_size, _, _ = kv_cache.dims
        broken = split_violations(metadata, num_common_prefix_blocks, block_size=block_size, params=params)
        if np.asarray(broken).any():
            raise ValueError(
                f"{num_common_prefix_blocks=} does not split requests {np.flatnonzero(broken).tolist()}: their "
                "leading blocks differ from the first request's, their query starts inside the prefix, or their "
                f"keys reach past the layer's window or first chunk ({params.sliding_window=}, "
                f"{params.attention_chunk_size=})"
            )
    num_common_prefix_blocks = jnp.asarray(num_common_prefix_blocks, jnp.int32)
    if resolve_implementation(implementation, interpret) == "reference":
        return _cascade_reference(q, kv_cache, metadata, num_common_prefix_blocks, sinks, params=params)
    check_kernel_support(q, kv_cache)
    return _cascade_kernels(q, kv_cache, metadata, num_common_prefix_blocks, sinks, params=params, interpret=interpret)


def split_violations(
    metadata: AttentionMetadata,
    num_common_prefix_blocks: int | Int[Array, ""],
    *,
    block_size: int,
    params: LayerAttentionParams = CAUSAL,
) -> Bool[Array, "R"]:
    """[R] bool: the requests that a split after `num_common_prefix_blocks` blocks cannot serve: a leading block
    other than the first request's (the first with a query), a query that starts inside the prefix, or (with a
    prefix) keys past the layer's window or first chunk (the prefix part attends without them: every query must
    see the whole prefix, and a chunked layer's suffix its whole chunk). Requests without queries never break
    it. Traceable."""
    check_metadata(metadata)
    _check_prefix_blocks(num_common_prefix_blocks, metadata)
    block_size = check_int("block_size", block_size)
    check_params(params)
    tables, seq_lens, query_lens = metadata.block_tables, metadata.seq_lens, metadata.query_lens
    leading = jnp.arange(tables.shape[1]) < num_common_prefix_blocks
    broken = jnp.any(leading & (tables != _prefix_table(metadata)), axis=1)
    broken |= seq_lens - query_lens < num_common_prefix_blocks * block_size
    for reach in (params.sliding_window, params.attention_chunk_size):
        if reach is not None:
            broken |= (num_common_prefix_blocks > 0) & (seq_lens > reach)
    return broken & (query_lens > 0)


def cascade_pays(
    *, num_reqs: int, num_query_tokens: int, prefix_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    kv_itemsize: int,
) -> bool:
    """Whether a step should split off a prefix of `prefix_len` tokens that `num_reqs` requests with
    `num_query_tokens` query tokens share, on the kernels: the host-side cost rule, as vLLM's
    ``use_cascade_attention`` (which compares CTA waves of FlashAttention's two paths).

    Plain attention reads the prefix once per request; the split reads it once, but adds launches and a merge
    and computes every query against it at the prefix part's (compute-bound) rate. Measured, not modelled: the
    constants above come from `benchmarks/cascade.py`, and `CASCADE_MARGIN` leaves the close cases (a few
    requests, a short prefix) to plain attention. Counts are ints >= 0, sizes ints >= 1 (`ValueError`)."""
    counts = dict(num_reqs=num_reqs, num_query_tokens=num_query_tokens, prefix_len=prefix_len)
    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    sizes["kv_itemsize"] = kv_itemsize
    for name, value in counts.items():
        check_int(name, value, minimum=0, maximum=None)
    for name, value in sizes.items():
        check_int(name, value, maximum=None)
    if num_reqs < 2 or prefix_len <= 0:
        return False
    plain_us = num_reqs * prefix_len * num_kv_heads * head_dim * 2 * kv_itemsize / PLAIN_PREFIX_BYTES_PER_US
    prefix_flops = 4 * num_query_tokens * num_q_heads * prefix_len * head_dim
    cascade_us = CASCADE_FIXED_US + CASCADE_PER_REQUEST_US * num_reqs + prefix_flops / CASCADE_FLOPS_PER_US
    return bool(plain_us > CASCADE_MARGIN * cascade_us)


@partial(jax.jit, static_argnames=("params",))
def _cascade_reference(q, kv_cache, metadata, num_common_prefix_blocks, sinks, *, params):
    """The two parts at the keys' true positions and masks, the prefix read from the first request's blocks."""
    _, block_size, _, _ = kv_cache.dims
    prefix_len = num_common_prefix_blocks * block_size
    shared = metadata.replace(block_tables=jnp.broadcast_to(_prefix_table(metadata), metadata.block_tables.shape))
    prefix = reference.attention_parts(q, kv_cache, shared, params=params, keys_before=prefix_len)
    suffix = reference.attention_parts(q, kv_cache, metadata, params=params, keys_from=prefix_len)
    broken = _broken(metadata, num_common_prefix_blocks, kv_cache, params=params)
    return _merged(q, metadata, prefix, suffix, sinks, broken)


@partial(jax.jit, static_argnames=("params", "interpret"))
def _cascade_kernels(q, kv_cache, metadata, num_common_prefix_blocks, sinks, *, params, interpret):
    """The prefix part as one non-causal request holding every query token, over the first request's leading
    blocks (each of its query tiles reads them once); the suffix part as the
    requests with their tables and lengths shifted past the prefix (masks that only compare positions are
    unchanged by the shift; a chunk is the whole request's, as `split_violations` requires)."""
    num_tokens = q.shape[0]
    _, block_size, _, _ = kv_cache.dims
    prefix_len = num_common_prefix_blocks * block_size
    tables = metadata.block_tables
    prefix_metadata = metadata.replace(
        query_start_loc=jnp.stack([0, metadata.num_actual_tokens]).astype(jnp.int32),
        seq_lens=prefix_len[None].astype(jnp.int32), block_tables=_prefix_table(metadata), max_query_len=num_tokens,
        causal=False,
    )  # fmt: skip
    prefix_params = dataclasses.replace(params, causal=False, sliding_window=None, attention_chunk_size=None)
    prefix = paged_attention_parts_kernels(
        q, kv_cache, prefix_metadata, jnp.zeros(1, bool), params=prefix_params, interpret=interpret
    )
    shifted = jnp.arange(tables.shape[1]) + num_common_prefix_blocks
    suffix_metadata = metadata.replace(
        block_tables=jnp.where(shifted < tables.shape[1], tables[:, jnp.minimum(shifted, tables.shape[1] - 1)],
                               NULL_BLOCK_ID),
        seq_lens=jnp.maximum(metadata.seq_lens - prefix_len, 0),  # below 0: a broken request, flagged
    )  # fmt: skip
    broken = _broken(metadata, num_common_prefix_blocks, kv_cache, params=params)
    suffix = paged_attention_parts_kernels(
        q, kv_cache, suffix_metadata, broken, params=dataclasses.replace(params, attention_chunk_size=None),
        interpret=interpret,
    )  # fmt: skip
    return _merged(q, metadata, prefix, suffix, sinks, broken)


def _check_prefix_blocks(num_common_prefix_blocks, metadata: AttentionMetadata) -> None:
    """`ValueError` unless the count is an int or an integer scalar array, in ``[0, P]`` where concrete."""
    width = metadata.block_tables.shape[1]
    count = check_int_scalar("num_common_prefix_blocks", num_common_prefix_blocks, minimum=-INT32_MAX)  # its kind
    if not isinstance(count, jax.core.Tracer) and not 0 <= count <= width:
        raise ValueError(f"num_common_prefix_blocks={int(count)} must be in [0, {width}] (the block tables' width)")


def _prefix_table(metadata: AttentionMetadata) -> Int[Array, "1 P"]:
    """The block table the prefix is read from: the first request's with a query (padding rows and requests
    without tokens in the step hold no prefix)."""
    lead = jnp.argmax(metadata.query_lens > 0)
    return jax.lax.dynamic_slice_in_dim(metadata.block_tables, lead, 1)


def _broken(metadata, num_common_prefix_blocks, kv_cache: KVCache, *, params) -> Bool[Array, "R"]:
    """The requests whose tokens come out NaN: those the metadata or the split cannot serve."""
    num_blocks, block_size, _, _ = kv_cache.dims
    broken = unservable_requests(metadata, block_size=block_size, num_blocks=num_blocks)
    return broken | split_violations(metadata, num_common_prefix_blocks, block_size=block_size, params=params)


def _merged(q, metadata, prefix, suffix, sinks, broken):
    """The two parts merged with the sinks, in q's dtype; NaN for the tokens of the `broken` requests, 0 for
    padding."""
    out = merge_splits(
        jnp.stack([prefix[0], suffix[0]], axis=2), jnp.stack([prefix[1], suffix[1]], axis=-1),
        None if sinks is None else sinks.astype(jnp.float32),
    )  # fmt: skip
    token = jnp.arange(q.shape[0])
    request = token_requests(metadata.query_start_loc, token)
    out = jnp.where(broken[request][:, None, None], jnp.nan, out)
    return jnp.where((token < metadata.query_start_loc[-1])[:, None, None], out, 0.0).astype(q.dtype)
