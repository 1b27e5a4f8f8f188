"""Which key positions a query position may attend to: predicates and their interval form.

Every rule is a comparison of absolute positions within one request (query position ``q``, key
position ``k``, both counted from the request's first token), in the convention of `params.py`:
  causal         k <= q
  sliding window q - W < k              (the W most recent positions, q itself included)
  chunked local  k // C == q // C
A combination allows a key when every rule that is on allows it and both positions exist (``< seq_len``).
The predicates broadcast over numpy and jax arrays alike. Since each rule allows an interval of keys, so
does their combination: `allowed_key_range` gives its first and last key, which kernels use to skip
whole blocks. Both also take the window as a value (``sliding_window=``, which may be traced): the kernels read
it from memory, so that layers that differ only in their window share one compiled kernel.

Positions, lengths, windows and chunks are integers: Python or numpy ints, or integer arrays (jax arrays
may be traced; torch tensors are taken by the predicates, as transformers' mask functions call them). A window or chunk given as a concrete value must be an int in ``[1, 2**31 - 1]`` (`ValueError`
naming it otherwise); a traced one is read on the device, where it cannot be checked: a traced window below 1
masks every key.
"""

import jax.numpy as jnp
import numpy as np

from .integers import check_int_scalar, is_int
from .params import CAUSAL, LayerAttentionParams, check_params

__all__ = ["causal_mask", "sliding_window_mask", "chunked_local_mask", "attention_mask", "allowed_key_range"]


def _is_integer_array(value) -> bool:
    """Whether `value` is an array of integers: numpy's, jax's, or another library's whose dtype names one
    (a torch tensor's ``torch.int64``: transformers' mask functions call the predicates with torch tensors)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    try:
        return jnp.issubdtype(np.dtype(str(dtype).removeprefix("torch.")), jnp.integer)
    except TypeError:
        return False


def _check_integers(name: str, value) -> None:
    """`ValueError` naming `name` unless `value` is an int (Python or numpy, not a bool) or an integer
    array."""
    if not (is_int(value) or _is_integer_array(value)):
        kind = f"{value.dtype} array" if hasattr(value, "dtype") else type(value).__name__
        raise ValueError(f"{name}={value!r:.80} ({kind}) must be an int or an integer array")


def causal_mask(q_pos, k_pos):
    """True where key `k_pos` is not after query `q_pos`."""
    _check_integers("q_pos", q_pos)
    _check_integers("k_pos", k_pos)
    return k_pos <= q_pos


def sliding_window_mask(q_pos, k_pos, sliding_window: int):
    """True where `k_pos` is among the `sliding_window` positions ending at `q_pos` (or after it)."""
    _check_integers("q_pos", q_pos)
    _check_integers("k_pos", k_pos)
    return q_pos - k_pos < check_int_scalar("sliding_window", sliding_window)


def chunked_local_mask(q_pos, k_pos, attention_chunk_size: int):
    """True where `k_pos` and `q_pos` lie in the same chunk of `attention_chunk_size` positions."""
    _check_integers("q_pos", q_pos)
    _check_integers("k_pos", k_pos)
    chunk = check_int_scalar("attention_chunk_size", attention_chunk_size)
    return k_pos // chunk == q_pos // chunk


def _window(params: LayerAttentionParams, sliding_window):
    """The window in force: `params`' or the `sliding_window` value given for it (params then has none)."""
    check_params(params)
    if sliding_window is None:
        return params.sliding_window
    if params.sliding_window is not None:
        raise ValueError(f"{params.sliding_window=} and a sliding_window value: give the window once")
    return check_int_scalar("sliding_window", sliding_window)


def attention_mask(q_pos, k_pos, seq_len, *, params: LayerAttentionParams = CAUSAL, sliding_window=None):
    """True where query `q_pos` attends to key `k_pos` of a request holding `seq_len` keys, for a layer of
    `params` (its causality, window and chunk); `sliding_window`, a value that may be traced, stands for a
    window that `params` does not hold."""
    window = _window(params, sliding_window)
    for name, value in (("q_pos", q_pos), ("k_pos", k_pos), ("seq_len", seq_len)):
        _check_integers(name, value)
    allowed = (0 <= k_pos) & (k_pos < seq_len) & (q_pos < seq_len)
    if params.causal:
        allowed = allowed & causal_mask(q_pos, k_pos)
    if window is not None:
        allowed = allowed & sliding_window_mask(q_pos, k_pos, window)
    if params.attention_chunk_size is not None:
        allowed = allowed & chunked_local_mask(q_pos, k_pos, params.attention_chunk_size)
    return allowed


def allowed_key_range(q_pos, seq_len, *, params: LayerAttentionParams = CAUSAL, sliding_window=None):
    """First and last key position (both inclusive) that query `q_pos` attends to (`sliding_window` as in
    `attention_mask`).

    For ``0 <= q_pos < seq_len`` the range is never empty: the query's own position is always allowed.
    Works elementwise on arrays and returns jax arrays;
    ``attention_mask(q, k, n, params=p) == (first <= k) & (k <= last)``.
    """
    window = _window(params, sliding_window)
    _check_integers("q_pos", q_pos)
    _check_integers("seq_len", seq_len)
    first = jnp.zeros_like(q_pos)
    last = q_pos if params.causal else jnp.broadcast_to(seq_len - 1, jnp.shape(q_pos))
    if window is not None:  # compared before subtracting: a negative q_pos minus a huge window overflows int32
        first = jnp.where(q_pos >= window, q_pos - window + 1, first)
    if params.attention_chunk_size is not None:
        chunk = params.attention_chunk_size
        chunk_start = (q_pos // chunk) * chunk
        first = jnp.maximum(first, chunk_start)
        last = jnp.minimum(last, chunk_start + chunk - 1)
    return first, last
