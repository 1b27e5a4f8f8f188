"""The reference: paged attention in plain `jax.numpy`, the oracle for every kernel.

Obviously correct rather than fast. For each query token it gathers its request's whole block table,
computes float32 logits against every key position, and masks with `masks.attention_mask`; masked keys
contribute neither logits nor values, so whatever a masked or unused block holds (NaN included) cannot
reach the output.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .layout import KVArrays, KVCache
from .masks import attention_mask
from .metadata import AttentionMetadata, token_requests
from .params import CAUSAL, LayerAttentionParams
from .softmax_merge import merge_splits
from .validation import check_paged_attention_args, unservable_requests

__all__ = ["paged_attention"]

EXACT = jax.lax.Precision.HIGHEST
"""float32 products in full float32 on every backend (a GPU would otherwise use TF32 for float32 matmuls)."""

TOKENS_PER_MAP_STEP = 8  # queries computed together by lax.map; bounds the gathered [.., P*S, K, H] memory


def paged_attention(
    q: Float[Array, "T N H"],
    kv_cache: KVCache | KVArrays,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams = CAUSAL,
    sinks: Float[Array, "N"] | None = None,
    checked: bool = False,
) -> Float[Array, "T N H"]:
    """Attention of each query token over its request's paged keys and values.

    Args:
      q: [T, N, H] queries; token t belongs to the request r with
        ``query_start_loc[r] <= t < query_start_loc[r+1]``. Padding tokens get zeros.
      kv_cache: a `KVCache`: arrays [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND", "HND_VT"), or the pair
        ``(k_cache, v_cache)`` of [B, S, K, H] / [B, K, S, H] each, in `q`'s dtype or float8_e4m3fn (then with its
        per-tensor `k_scale` / `v_scale`); or an "NHD" cache's array or pair alone (`layout.as_kv_cache`).
      metadata: where each request's queries and blocks are (its ``num_common_prefix_blocks`` and
        ``kernel_plan`` are not read: this is plain attention, which a valid cascade split equals; the cascade
        twin is `cascade.cascade_attention` with ``implementation="reference"``).
      params: the layer's scale, window, chunk, soft cap and causality (`LayerAttentionParams`);
        ``params.causal`` must equal ``metadata.causal``.
      sinks: [N] one learned logit per query head, unscaled, in the softmax denominator only; finite (checked
        where concrete; a traced sink cannot be checked, and a non-finite one gives meaningless outputs).
      checked: also validate the metadata's values (`check_metadata_values`: block ids in the pool, lengths
        within the tables, query offsets, slots in the cache, none in the null block and none twice, the static
        bounds; with this layer's window and chunk, no key position a query attends in the null block and no
        block read that this step writes for another request) and that the sinks are concrete; needs concrete
        arrays. Always checked: types, dtypes, shapes and options. Not checked: the cache's contents (a block
        another request filled earlier is read as the table says). Unchecked values never give a wrong number
        where the kernels can tell: a request the metadata cannot serve (a sequence beyond its table, a block id
        outside the pool, a query longer than ``max_query_len``) gets NaN output, on the kernels and here alike;
        a table that points at the null block or at another request's block is read as it says. A traced float8
        scale that is not finite and > 0 makes the outputs it touches NaN (a concrete one is refused).

    Returns:
      [T, N, H] in ``q.dtype``. Query head n reads KV head ``n // (N // K)``.
    """
    params, kv_cache = check_paged_attention_args(
        q, kv_cache, metadata, params=params, sinks=sinks, checked=checked
    )
    return _paged_attention(q, kv_cache, metadata, sinks, params=params)


@partial(jax.jit, static_argnames=("params",))
def _paged_attention(q, kv_cache, metadata, sinks, *, params):
    num_blocks, block_size, _, _ = kv_cache.dims
    out, lse = attention_parts(q, kv_cache, metadata, params=params)
    out = merge_splits(out[:, :, None], lse[:, :, None], None if sinks is None else sinks.astype(jnp.float32))
    request = token_requests(metadata.query_start_loc, jnp.arange(q.shape[0]))
    unservable = unservable_requests(metadata, block_size=block_size, num_blocks=num_blocks)[request]
    out = jnp.where(unservable[:, None, None], jnp.nan, out)  # flagged, never a wrong number
    is_query = jnp.arange(q.shape[0]) < metadata.query_start_loc[-1]
    return jnp.where(is_query[:, None, None], out, 0.0).astype(q.dtype)


def attention_parts(
    q: Float[Array, "T N H"],
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    *,
    params: LayerAttentionParams,
    keys_from: Int[Array, ""] | int = 0,
    keys_before: Int[Array, ""] | int | None = None,
) -> tuple[Float[Array, "T N H"], Float[Array, "T N"]]:
    """Each query token's attention, without sinks, over the keys its mask allows at positions in
    ``[keys_from, keys_before)`` (`keys_before` None: no end), in float32 with `params` resolved
    (`check_paged_attention_args`): (the output normalized over those keys, 0 where there is none [T, N, H]; the
    log-sum-exp of their logits, -inf where there is none [T, N]), the parts that `softmax_merge.merge_splits`
    combines. Padding tokens and unservable requests are not marked."""
    num_tokens, num_q_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache.halves_nhd()
    k_scale, v_scale = kv_cache.scales()
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_q_heads // num_kv_heads
    num_reqs, max_blocks = metadata.block_tables.shape

    # Each request's keys and values, contiguous: [R, P*S, K, H].
    keys = k_cache[metadata.block_tables].reshape(num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[metadata.block_tables].reshape(num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
    key_positions = jnp.arange(max_blocks * block_size)
    query_lens = metadata.query_lens

    def attend(token):
        request = token_requests(metadata.query_start_loc, token)
        seq_len = metadata.seq_lens[request]
        q_pos = seq_len - query_lens[request] + token - metadata.query_start_loc[request]
        allowed = attention_mask(q_pos, key_positions, seq_len, params=params) & (key_positions >= keys_from)
        if keys_before is not None:
            allowed &= key_positions < keys_before
        k = keys[request].astype(jnp.float32) * k_scale  # [P*S, K, H]
        v = jnp.where(allowed[:, None, None], values[request].astype(jnp.float32) * v_scale, 0.0)
        q_t = q[token].astype(jnp.float32).reshape(num_kv_heads, group_size, head_dim)
        return softmax_part(jnp.einsum("kgh,pkh->kgp", q_t, k, precision=EXACT), allowed, v, params=params)

    out, lse = jax.lax.map(attend, jnp.arange(num_tokens), batch_size=TOKENS_PER_MAP_STEP)
    return out.reshape(num_tokens, num_q_heads, head_dim), lse.reshape(num_tokens, num_q_heads)


def softmax_part(
    products: Float[Array, "K G P"],
    allowed: Bool[Array, "P"],
    v: Float[Array, "P K H"],
    *,
    params: LayerAttentionParams,
) -> tuple[Float[Array, "K G H"], Float[Array, "K G"]]:
    """One query token's attention over the `allowed` of P keys, from its q·k products (unscaled) and the values
    (zero where not allowed): (the output normalized over them, 0 where none is allowed; their log-sum-exp, -inf
    where none is)."""
    logits = products * params.sm_scale
    if params.logits_soft_cap is not None:
        logits = params.logits_soft_cap * jnp.tanh(logits / params.logits_soft_cap)
    logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = logits.max(axis=-1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max[..., None])
    denominator = weights.sum(axis=-1)
    out = jnp.einsum("kgp,pkh->kgh", weights, v, precision=EXACT)
    out = out / jnp.where(denominator > 0, denominator, 1.0)[..., None]
    return out, jnp.where(denominator > 0, row_max + jnp.log(denominator), -jnp.inf)
