"""`AttentionLayer`: one attention layer of a PyTorch model as the backend takes it (vLLM's `AttentionImpl`
arguments), checked when it is made."""

import dataclasses
import functools
import math
import numbers

import torch

from jax_hybrid_attn import LayerAttentionParams
from jax_hybrid_attn.integers import check_int

__all__ = ["AttentionLayer"]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionLayer:
    """One attention layer: vLLM's `AttentionImpl` arguments.

    Attributes:
      num_heads, num_kv_heads, head_size: N, K, H.
      scale: logits scale (None: ``head_size ** -0.5``).
      sliding_window: the W most recent positions, the query's own included (None: no window).
      attention_chunk_size: chunked-local attention over chunks of C positions (None: none).
      logits_soft_cap: ``cap * tanh(logits / cap)`` (None: none).
      sinks: [N] learned sink logits (gpt-oss), finite, or None.
      causal: keys after the query are masked.
      kv_cache_group: which of the step's block tables and slot mappings this layer's cache uses.
      k_scale, v_scale: dequantization scales of a float8 cache.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None
    causal: bool = True
    kv_cache_group: int = 0
    k_scale: float | None = None
    v_scale: float | None = None

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            check_int(name, value)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.sinks is not None:
            if not isinstance(self.sinks, torch.Tensor) or not self.sinks.is_floating_point():
                tensor = isinstance(self.sinks, torch.Tensor)
                got = f"a {self.sinks.dtype} tensor" if tensor else type(self.sinks).__name__
                raise ValueError(
                    f"sinks must be a float torch.Tensor of shape (num_heads={self.num_heads},), got {got}"
                )
            if tuple(self.sinks.shape) != (self.num_heads,):
                raise ValueError(f"sinks.shape={tuple(self.sinks.shape)} must be (num_heads={self.num_heads},)")
            if not bool(torch.isfinite(self.sinks).all()):  # read once, when the layer is made
                raise ValueError(f"sinks={self.sinks.tolist()} must be finite")
        if isinstance(self.kv_cache_group, bool) or not isinstance(self.kv_cache_group, int) or self.kv_cache_group < 0:
            raise ValueError(f"kv_cache_group={self.kv_cache_group!r} must be an int >= 0")
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                                      or not (math.isfinite(scale) and scale > 0)):  # fmt: skip
                raise ValueError(f"{name}={scale!r} must be a finite number > 0 (or None)")
        self.params

    @functools.cached_property
    def params(self) -> LayerAttentionParams:
        return LayerAttentionParams(
            sm_scale=self.scale,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
            logits_soft_cap=self.logits_soft_cap,
            causal=self.causal,
        )
