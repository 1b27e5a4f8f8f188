"""The JAX calls whose spelling changes between releases, in one place (pinned: jax 0.11.2).

When the pin moves, this module is the one to re-check: `register_dataclass` field arguments,
the Mosaic GPU import path and interpret-mode parameters (public from 0.11.1), and
`jax.nn.dot_product_attention`'s `local_window_size`.
"""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["register_pytree_dataclass", "plgpu", "interpret_params", "dense_attention"]


def register_pytree_dataclass(cls, *, data_fields: list[str], meta_fields: list[str]):
    """Register a dataclass as a pytree: `data_fields` are traced leaves, `meta_fields` static."""
    return jax.tree_util.register_dataclass(cls, data_fields=data_fields, meta_fields=meta_fields)


def interpret_params(*, detect_races: bool = False) -> "plgpu.InterpretGPUParams":
    """Mosaic GPU interpret mode on the CPU; uninitialized memory reads as NaN so stray reads show."""
    return plgpu.InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")


def dense_attention(q, k, v, *, scale: float, is_causal: bool, local_window_size):
    """`jax.nn.dot_product_attention` on [batch, seq, heads, head_dim] inputs, XLA implementation."""
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, local_window_size=local_window_size, implementation="xla"
    )
