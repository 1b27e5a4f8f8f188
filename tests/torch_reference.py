"""Torch-only reference of paged attention and of the KV-cache write, for the interop parity tests.

This module is the independent check of `jax_hybrid_attn` from the PyTorch side: it uses torch ops only and
never imports JAX or `jax_hybrid_attn`. It is written for clarity, not speed (a Python loop over requests,
float32 math), and follows the package's conventions:

Shape letters: T query tokens (flattened, padding included) · R requests · N query heads · K kv heads ·
H head_dim · B blocks in the pool · S block_size · P max blocks per request.

* KV cache: "NHD" [B, 2, S, K, H] or "HND" [B, 2, K, S, H] ("HND_VT": "HND" with V's [S, H] per block and head
  holding V transposed); index 0 of axis 1 is K, 1 is V. Key position p of request r lives in block
  ``block_tables[r, p // S]`` at offset ``p % S``.
* Request r owns query tokens ``query_start_loc[r] : query_start_loc[r + 1]``; they are the last ``query_len``
  of its ``seq_lens[r]`` positions, so query i sits at position ``seq_lens[r] - query_len + i``.
* Query head n reads KV head ``n // (N // K)`` (GQA / MQA / MHA).
* Masks, on absolute positions q (query) and k (key) of one request, all rules that are on must hold, and
  ``k < seq_len``:  causal ``k <= q``;  sliding window W ``q - k < W`` (the W most recent positions, the
  query's own included);  chunked local C ``k // C == q // C``. With ``causal=False`` the window and chunk
  rules still apply as written, so a non-causal window reaches every later key of the request, and a
  non-causal chunk covers its whole chunk (up to ``seq_len``).
* Logits: ``(q . k) * sm_scale`` (``sm_scale=None`` means ``H ** -0.5``), then ``cap * tanh(x / cap)`` when
  `logits_soft_cap` is set, then masking.
* Sinks: one unscaled logit per query head that joins the softmax denominator only (gpt-oss).
* float8_e4m3fn cache: stores ``x / scale`` saturated at ±448; reading multiplies by the per-tensor scale.
"""

import torch

__all__ = ["paged_attention_torch", "write_kv_torch"]

PAD_SLOT_ID = -1
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_LAYOUTS = ("NHD", "HND", "HND_VT")


def _halves_nhd(kv_cache: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, K, H] views of the cache's K and V (transposed views for "HND"; for "HND_VT", whose V holds [H, S]
    per block and head, a reshaped and permuted one)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} must be one of {KV_LAYOUTS}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)} must be [B, 2, S, K, H] or [B, 2, K, S, H]")
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    if kv_layout == "NHD":
        return k_cache, v_cache
    if kv_layout == "HND_VT":
        num_blocks, num_kv_heads, block_size, head_dim = v_cache.shape
        v_transposed = v_cache.view(num_blocks, num_kv_heads, head_dim, block_size)
        return k_cache.transpose(1, 2), v_transposed.permute(0, 3, 1, 2)
    return k_cache.transpose(1, 2), v_cache.transpose(1, 2)


def _resolve_scales(kv_dtype: torch.dtype, k_scale, v_scale) -> tuple[float, float]:
    """Per-tensor scales as floats; they apply only to a float8_e4m3fn cache, where they default to 1."""
    if kv_dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale apply only to a {FP8_DTYPE} cache, not {kv_dtype}")
        return 1.0, 1.0
    scales = tuple(1.0 if s is None else float(s) for s in (k_scale, v_scale))
    if not all(s > 0 for s in scales):
        raise ValueError(f"k_scale={k_scale!r}, v_scale={v_scale!r} must be > 0")
    return scales


def _quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache dtype; float8_e4m3fn stores ``x / scale`` clamped to ±448 (torch would give NaN)."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(dtype)


@torch.no_grad()
def write_kv_torch(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Write each token's K/V into its cache slot, in place (vLLM's ``reshape_and_cache_flash``).

    Args:
      kv_cache: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND", "HND_VT"); modified in place.
      k, v: [T, K, H] this step's keys and values.
      slot_mapping: [T] integer slots ``block_id * S + offset``; tokens with slot -1 (padding) are dropped.
      k_scale, v_scale: per-tensor scales of a float8_e4m3fn cache (default 1), which stores ``x / scale``
        saturated at ±448.
    """
    k_cache, v_cache = _halves_nhd(kv_cache, kv_layout)  # views: writes land in kv_cache
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, K={num_kv_heads}, H={head_dim}]"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [T={k.shape[0]}]")
    k_scale, v_scale = _resolve_scales(kv_cache.dtype, k_scale, v_scale)

    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    keep = slots != PAD_SLOT_ID
    slots = slots[keep]
    if slots.numel() and (slots.min() < 0 or slots.max() >= num_blocks * block_size):
        raise ValueError(
            f"slot_mapping holds slots outside [0, {num_blocks * block_size}) other than {PAD_SLOT_ID}"
        )
    block, offset = slots // block_size, slots % block_size
    keep = keep.to(k.device)
    k_cache[block, offset] = _quantize(k[keep], k_scale, kv_cache.dtype).to(kv_cache.device)
    v_cache[block, offset] = _quantize(v[keep], v_scale, kv_cache.dtype).to(kv_cache.device)


def _allowed(q_pos, k_pos, seq_len, *, causal, sliding_window, attention_chunk_size) -> torch.Tensor:
    """[Q, L] bool: query position q_pos[i] may attend to key position k_pos[j]."""
    q_pos, k_pos = q_pos[:, None], k_pos[None, :]
    allowed = (k_pos >= 0) & (k_pos < seq_len) & (q_pos < seq_len)
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    if sliding_window is not None:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    if attention_chunk_size is not None:
        allowed = allowed & (k_pos // attention_chunk_size == q_pos // attention_chunk_size)
    return allowed


@torch.no_grad()
def paged_attention_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    kv_layout: str = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:
    """Attention of each query token over its request's paged keys and values, in float32.

    Args:
      q: [T, N, H] queries; tokens at or past ``query_start_loc[-1]`` are padding and get zeros.
      kv_cache: [B, 2, S, K, H] ("NHD") or [B, 2, K, S, H] ("HND", "HND_VT"), q's dtype or float8_e4m3fn.
      query_start_loc: [R+1] cumulative query lengths, starting at 0.
      seq_lens: [R] context length of each request, this step's queries included.
      block_tables: [R, P] block ids; only the blocks holding the first ``seq_lens[r]`` positions are read.
      sm_scale: logits scale; None means ``H ** -0.5``.
      sliding_window: W, attend to keys with ``q_pos - k_pos < W`` (the query's own position included).
      attention_chunk_size: C, attend to keys with ``k_pos // C == q_pos // C``.
      logits_soft_cap: ``cap * tanh(logits / cap)`` on the scaled logits, before masking.
      sinks: [N] one unscaled logit per query head, added to the softmax denominator only.
      causal: mask keys after the query (``k_pos > q_pos``).
      kv_layout: "NHD", "HND" or "HND_VT" (V transposed per block and head).
      k_scale, v_scale: per-tensor dequantization scales of a float8_e4m3fn cache (default 1).

    Returns:
      [T, N, H] in q's dtype. Query head n reads KV head ``n // (N // K)``. A query row that sees no key
      (impossible for valid metadata, where the query's own position is always visible) gets zeros.

    Cache slots past a request's ``seq_len`` are never read; slots inside it that no query of the request may
    see (e.g. NULL_BLOCK_ID blocks left of a window) are read but replaced by zeros before any arithmetic,
    so NaN there cannot reach the output.
    """
    k_cache, v_cache = _halves_nhd(kv_cache, kv_layout)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q.shape={tuple(q.shape)} does not fit the cache's K={num_kv_heads}, H={head_dim}")
    if kv_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"kv_cache.dtype={kv_cache.dtype} must equal q.dtype={q.dtype} or be {FP8_DTYPE}")
    k_scale, v_scale = _resolve_scales(kv_cache.dtype, k_scale, v_scale)
    sm_scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    group_size = num_q_heads // num_kv_heads
    device = q.device

    starts = [int(x) for x in query_start_loc.tolist()]
    lengths = [int(x) for x in seq_lens.tolist()]
    tables = block_tables.to(device=kv_cache.device, dtype=torch.int64)
    if len(starts) != len(lengths) + 1 or tables.shape[0] != len(lengths):
        raise ValueError("query_start_loc must be [R+1], seq_lens [R] and block_tables [R, P]")
    if starts[0] != 0 or starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc={starts} must start at 0 and end at most at T={num_tokens}")
    sink_logits = None if sinks is None else sinks.to(device=device, dtype=torch.float32).reshape(num_q_heads)

    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=device)
    for r, seq_len in enumerate(lengths):
        query_len = starts[r + 1] - starts[r]
        if query_len == 0:
            continue
        capacity = tables.shape[1] * block_size
        if not 0 < query_len <= seq_len <= capacity:
            raise ValueError(
                f"request {r}: need 0 < query_len={query_len} <= seq_len={seq_len} <= P*S={capacity}"
            )

        # Gather this request's first seq_len positions, slot by slot: [L, K, H] with L = seq_len.
        k_pos = torch.arange(seq_len, device=kv_cache.device)
        blocks = tables[r, k_pos // block_size]
        keys = k_cache[blocks, k_pos % block_size].to(device=device, dtype=torch.float32) * k_scale
        values = v_cache[blocks, k_pos % block_size].to(device=device, dtype=torch.float32) * v_scale

        q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        allowed = _allowed(
            q_pos, k_pos.to(device), seq_len,
            causal=causal, sliding_window=sliding_window, attention_chunk_size=attention_chunk_size,
        )  # fmt: skip  # [Q, L]
        # Keys no query of the request may see can hold anything (NaN in null blocks): zero them.
        seen = allowed.any(dim=0)[:, None, None]
        keys = torch.where(seen, keys, 0.0).repeat_interleave(group_size, dim=1)  # [L, N, H]
        values = torch.where(seen, values, 0.0).repeat_interleave(group_size, dim=1)  # [L, N, H]

        queries = q[starts[r] : starts[r + 1]].to(torch.float32)  # [Q, N, H]
        logits = torch.einsum("qnh,lnh->nql", queries, keys) * sm_scale  # [N, Q, L]
        if logits_soft_cap is not None:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        logits = logits.masked_fill(~allowed, float("-inf"))

        row_max = logits.amax(dim=-1)  # [N, Q]; -inf for a row that sees no key
        if sink_logits is not None:
            row_max = torch.maximum(row_max, sink_logits[:, None])
        row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
        weights = torch.exp(logits - row_max[..., None])  # exactly 0 where masked
        denominator = weights.sum(dim=-1)
        if sink_logits is not None:
            denominator = denominator + torch.exp(sink_logits[:, None] - row_max)
        numerator = torch.einsum("nql,lnh->qnh", weights, values)
        denominator = denominator.transpose(0, 1)[..., None]  # [Q, N, 1]
        out[starts[r] : starts[r + 1]] = torch.where(denominator > 0, numerator / denominator, 0.0)
    return out.to(q.dtype)
