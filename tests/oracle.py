"""An independent float64 attention over contiguous per-request K/V, written without the package's masks."""

import numpy as np


def attention_float64(
    q,
    keys,
    values,
    query_lens,
    *,
    sm_scale=None,
    sliding_window=None,
    attention_chunk_size=None,
    logits_soft_cap=None,
    sinks=None,
    causal=True,
):
    """q: [T, N, H]; keys, values: per request [seq_len, K, H] (float64). Returns [T, N, H] float64."""
    q = np.asarray(q, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    start = 0
    for k, v, query_len in zip(keys, values, query_lens):
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        heads_per_kv = num_q_heads // num_kv_heads
        k = np.repeat(k, heads_per_kv, axis=1)  # [seq_len, N, H]
        v = np.repeat(v, heads_per_kv, axis=1)
        for i in range(query_len):
            position = seq_len - query_len + i
            key_pos = np.arange(seq_len)
            visible = np.ones(seq_len, bool)
            if causal:
                visible &= key_pos <= position
            if sliding_window is not None:
                visible &= key_pos >= position - sliding_window + 1
            if attention_chunk_size is not None:
                chunk_start = position - position % attention_chunk_size
                visible &= (key_pos >= chunk_start) & (key_pos < chunk_start + attention_chunk_size)
            logits = np.einsum("nh,snh->ns", q[start + i], k[visible]) * scale
            if logits_soft_cap is not None:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            extra = np.full((num_q_heads, 1), -np.inf) if sinks is None else np.asarray(sinks, np.float64)[:, None]
            all_logits = np.concatenate([logits, extra], axis=1)
            weights = np.exp(all_logits - all_logits.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[start + i] = np.einsum("ns,snh->nh", weights[:, :-1], v[visible])
        start += query_len
    return out
