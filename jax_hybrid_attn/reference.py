"""The reference: paged attention in plain `jax.numpy`, the oracle for every kernel.

Obviously correct rather than fast. For each query token it gathers its request's whole block table,
computes float32 logits against every key position, and masks with `masks.attention_mask`; masked keys
contribute neither logits nor values, so whatever a masked or unused block holds (NaN included) cannot
reach the output.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .layout import KVCache, KVLayout, kv_halves_nhd
from .masks import attention_mask
from .metadata import AttentionMetadata, token_requests
from .params import CAUSAL, LayerAttentionParams
from .validation import check_paged_attention_args, unservable_requests

__all__ = ["paged_attention"]

EXACT = jax.lax.Precision.HIGHEST
"""float32 products in full float32 on every backend (a GPU would otherwise use TF32 for float32 matmuls)."""

TOKENS_PER_MAP_STEP = 8  # queries computed together by lax.map; bounds the gathered [.., P*S, K, H] memory


def paged_attention(
    q: Float[Array, "T N H"],
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    kv_layout: KVLayout = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
    checked: bool = False,
) -> Float[Array, "T N H"]:
    """Attention of each query token over its request's paged keys and values.

    Args:
      q: [T, N, H] queries; token t belongs to the request r with
        ``query_start_loc[r] <= t < query_start_loc[r+1]``. Padding tokens get zeros.
      kv_cache: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND"), or the pair ``(k_cache, v_cache)`` of
        [B, S, K, H] / [B, K, S, H] each (`layout`); same dtype as `q` or float8_e4m3fn.
      metadata: where each request's queries and blocks are.
      params: the layer's scale, window, chunk, soft cap and causality (`LayerAttentionParams`);
        ``params.causal`` must equal ``metadata.causal``.
      sinks: [N] one learned logit per query head, unscaled, in the softmax denominator only.
      kv_layout: "NHD" or "HND".
      k_scale, v_scale: per-tensor dequantization scales of a float8_e4m3fn cache.
      checked: also validate the metadata's values (`check_metadata_values`: block ids in the pool, lengths
        within the tables, query offsets, slots in the cache and none twice, the static bounds); needs concrete
        arrays. Always checked: types, dtypes, shapes and options. Unchecked values never give a wrong number:
        a request the metadata cannot serve (a sequence beyond its table, a block id outside the pool, a query
        longer than ``max_query_len``) gets NaN output, on the kernels and here alike.

    Returns:
      [T, N, H] in ``q.dtype``. Query head n reads KV head ``n // (N // K)``.
    """
    params, k_scale, v_scale = check_paged_attention_args(
        q, kv_cache, metadata, params=params, sinks=sinks, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale,
        checked=checked,
    )  # fmt: skip
    return _paged_attention(q, kv_cache, metadata, sinks, k_scale, v_scale, params=params, kv_layout=kv_layout)


@partial(jax.jit, static_argnames=("params", "kv_layout"))
def _paged_attention(q, kv_cache, metadata, sinks, k_scale, v_scale, *, params, kv_layout):
    num_tokens, num_q_heads, head_dim = q.shape
    k_cache, v_cache = kv_halves_nhd(kv_cache, kv_layout)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_q_heads // num_kv_heads
    num_reqs, max_blocks = metadata.block_tables.shape

    # Each request's keys and values, contiguous: [R, P*S, K, H].
    keys = k_cache[metadata.block_tables].reshape(num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[metadata.block_tables].reshape(num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    key_positions = jnp.arange(max_blocks * block_size)
    unservable = unservable_requests(metadata, block_size=block_size, num_blocks=num_blocks)
    query_lens = metadata.query_lens

    def attend(token):
        request = token_requests(metadata.query_start_loc, token)
        seq_len = metadata.seq_lens[request]
        q_pos = seq_len - query_lens[request] + token - metadata.query_start_loc[request]
        allowed = attention_mask(q_pos, key_positions, seq_len, params=params)  # [P*S]
        k = keys[request].astype(jnp.float32) * k_scale  # [P*S, K, H]
        v = jnp.where(allowed[:, None, None], values[request].astype(jnp.float32) * v_scale, 0.0)
        q_t = q[token].astype(jnp.float32).reshape(num_kv_heads, group_size, head_dim)
        logits = jnp.einsum("kgh,pkh->kgp", q_t, k, precision=EXACT) * params.sm_scale
        if params.logits_soft_cap is not None:
            logits = params.logits_soft_cap * jnp.tanh(logits / params.logits_soft_cap)
        logits = jnp.where(allowed, logits, -jnp.inf)
        row_max = logits.max(axis=-1)
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group_size)
            row_max = jnp.maximum(row_max, sink)
        weights = jnp.exp(logits - row_max[..., None])
        denominator = weights.sum(axis=-1)
        if sinks is not None:
            denominator = denominator + jnp.exp(sink - row_max)
        out = jnp.einsum("kgp,pkh->kgh", weights, v, precision=EXACT) / denominator[..., None]
        is_query = token < metadata.query_start_loc[-1]
        out = jnp.where(unservable[request], jnp.nan, out)  # flagged, never a wrong number
        return jnp.where(is_query, out, 0.0).reshape(num_q_heads, head_dim)

    out = jax.lax.map(attend, jnp.arange(num_tokens), batch_size=TOKENS_PER_MAP_STEP)
    return out.astype(q.dtype)
