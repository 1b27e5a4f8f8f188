"""Attention computed in parts, merged by their log-sum-exps: the kernels' key splits, and cascade attention's
shared prefix and per-request suffix (`cascade`).

A part's output is normalized over its own keys and comes with the log-sum-exp of its logits (``-inf`` where it
saw no key). Sinks belong to no part: they enter the merged denominator once.
"""

import jax.numpy as jnp

__all__ = ["merge_splits"]


def merge_splits(partial_out, lse, sinks):
    """Combine splits: [..., splits, H] with lse [..., splits] -> [..., H] float32.

    `sinks` (broadcastable to lse's leading axes, or None) adds one unscaled logit per head to the softmax
    denominator only."""
    lse_max = lse.max(axis=-1)
    if sinks is not None:
        lse_max = jnp.maximum(lse_max, sinks)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lse - lse_max[..., None])  # [..., splits]
    denominator = weights.sum(axis=-1)
    if sinks is not None:
        denominator = denominator + jnp.exp(sinks - lse_max)
    out = (weights[..., None] * partial_out.astype(jnp.float32)).sum(axis=-2)
    return out / jnp.where(denominator > 0, denominator, 1.0)[..., None]
