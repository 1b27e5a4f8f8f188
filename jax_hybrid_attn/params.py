"""Per-layer attention parameters, the one window convention, and its converters to other libraries.

The window convention of this package (vLLM's, Gemma's, JAX ragged paged attention's):
  * ``sliding_window = W``: a query at position ``q`` attends to keys ``k`` with ``q - W < k``, i.e. the
    ``W`` most recent positions **including itself** (with ``causal``, also ``k <= q``).
  * ``attention_chunk_size = C``: a query attends to keys in its own chunk, ``k // C == q // C``
    (with ``causal``, also ``k <= q``).
The two are never aliased. Other libraries count differently; convert only through the functions below.

Per-layer parameters are never taken from a KV-cache group: a group's window applied to Gemma 3's global
layers silently drops context (a vLLM bug). Layers whose parameters differ get different metadata groups.
"""

import dataclasses
import math
import numbers

import jax
import numpy as np

from .integers import check_bool, check_int

__all__ = [
    "CAUSAL",
    "LayerAttentionParams",
    "metadata_group_key",
    "window_left",
    "local_window_size",
    "resolve_sm_scale",
]

NO_WINDOW_LEFT = -1
"""FlashInfer's `window_left` for "no sliding window"."""


def _optional_int(name: str, value) -> int | None:
    """None, or `value` as a Python int in [1, 2**31 - 1] (numpy integers accepted)."""
    return None if value is None else check_int(name, value)


def _optional_positive_float(name: str, value) -> float | None:
    """None, or `value` as a finite Python float > 0 (numpy floats and ints, and 0-d numpy or concrete JAX arrays
    of them, accepted; bools and strings not)."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name}={value!r} must be a concrete number: a layer's parameters are static under jit")
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0 and value.dtype != np.bool_:
        value = value.item()
    is_number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not (is_number and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0 or None")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAttentionParams:
    """What one attention layer computes, independent of where its KV cache lives.

    Attributes:
      sm_scale: logits scale; None means ``head_dim ** -0.5``.
      sliding_window: the W most recent positions, the query's own included; None for no window.
      attention_chunk_size: attend within the query's chunk of C positions; None for no chunking.
      logits_soft_cap: ``cap * tanh(logits / cap)`` before masking; None for no cap.
      causal: keys after the query are masked.

    The one static description of a layer's attention: `paged_attention`, its reference and kernels, the masks,
    `layer_attention`, the torch backend and the transformers function all take it as ``params=``. A layer's
    learned sinks and a float8 cache's k/v scales are arrays and stay separate arguments.
    """

    sm_scale: float | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None
    causal: bool = True

    def __post_init__(self):
        """Check every field and store it as a plain Python value (numpy scalars are converted), so that equal
        parameters hash alike as a static argument."""
        checked = dict(
            sm_scale=_optional_positive_float("sm_scale", self.sm_scale),
            sliding_window=_optional_int("sliding_window", self.sliding_window),
            attention_chunk_size=_optional_int("attention_chunk_size", self.attention_chunk_size),
            logits_soft_cap=_optional_positive_float("logits_soft_cap", self.logits_soft_cap),
            causal=check_bool("causal", self.causal),
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)


CAUSAL = LayerAttentionParams()
"""Plain causal attention: no window, chunk or soft cap, scale ``head_dim ** -0.5`` (the default ``params``)."""


def check_params(params) -> "LayerAttentionParams":
    """`params` itself, or `ValueError` naming it when it is not a `LayerAttentionParams`."""
    if not isinstance(params, LayerAttentionParams):
        raise ValueError(f"params={params!r} must be a LayerAttentionParams")
    return params


def metadata_group_key(params: LayerAttentionParams) -> tuple:
    """A hashable key: layers with equal keys may share one metadata object (one `plan`), layers with
    different keys never do. Differing windows, soft caps or scales are never an error, only another group."""
    return dataclasses.astuple(check_params(params))


def resolve_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    """FlashInfer's and vLLM's default: ``head_dim ** -0.5`` when `sm_scale` is None."""
    head_dim = check_int("head_dim", head_dim)
    return head_dim**-0.5 if sm_scale is None else _optional_positive_float("sm_scale", sm_scale)


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's `window_left` (keys strictly left of the query): ``W - 1``, or -1 for no window."""
    sliding_window = _optional_int("sliding_window", sliding_window)
    return NO_WINDOW_LEFT if sliding_window is None else sliding_window - 1


def local_window_size(sliding_window: int | None) -> tuple[int, int] | None:
    """`jax.nn.dot_product_attention`'s `local_window_size` for a causal layer: ``(W - 1, 0)``."""
    sliding_window = _optional_int("sliding_window", sliding_window)
    return None if sliding_window is None else (sliding_window - 1, 0)
