"""KV-cache specs: what one layer stores per block, and how much memory one request may need.

Frozen dataclasses with the names and formulas of vLLM's KV-cache specs, so layers with equal
specs can share one KV-cache group. Token counts follow the window convention of `params.py`.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from .integers import cdiv, check_int

__all__ = ["AttentionSpec", "ChunkedLocalAttentionSpec", "FullAttentionSpec", "SlidingWindowSpec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What one attention layer stores: `block_size` tokens × `num_kv_heads` × `head_size`, K and V."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: np.dtype

    def __post_init__(self):
        """Check every field and store it as a Python int or a numpy dtype (numpy ints are converted), so that
        equal specs hash alike."""
        for name in ("block_size", "num_kv_heads", "head_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        try:  # np.dtype(None) would be float64
            dtype = None if self.dtype is None else np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype={self.dtype!r} must be a floating-point dtype (the cache's)")
        object.__setattr__(self, "dtype", dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: K and V, `2 * block_size * num_kv_heads * head_size * itemsize`."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def max_num_blocks_per_request(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most blocks one request can hold in this layer at once (`ValueError` naming a length that is not an
        int in [1, 2**31 - 1])."""
        return self._max_num_blocks(
            max_model_len=check_int("max_model_len", max_model_len),
            max_num_batched_tokens=check_int("max_num_batched_tokens", max_num_batched_tokens),
        )

    def _max_num_blocks(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not define its block count")

    def max_memory_usage_bytes(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Most bytes one request can hold in this layer at once (vLLM's startup sizing)."""
        blocks = self.max_num_blocks_per_request(
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
        )
        return blocks * self.page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token of the request stays in the cache until the request ends."""

    def _max_num_blocks(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Only the last `sliding_window` positions (the query's own included) are kept."""

    sliding_window: int

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sliding_window", check_int("sliding_window", self.sliding_window))

    def _max_num_blocks(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        # The window may start inside a block, hence the extra block (vLLM's admission cap).
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Only the current chunk of `attention_chunk_size` positions is kept (Llama 4's local layers)."""

    attention_chunk_size: int

    def __post_init__(self):
        super().__post_init__()
        chunk = check_int("attention_chunk_size", self.attention_chunk_size)
        object.__setattr__(self, "attention_chunk_size", chunk)
        if self.attention_chunk_size % self.block_size:
            # vLLM's chunked-local manager frees and looks up whole blocks at chunk starts.
            raise ValueError(
                f"attention_chunk_size={self.attention_chunk_size} must be a multiple of block_size={self.block_size}"
            )

    def _max_num_blocks(self, *, max_model_len: int, max_num_batched_tokens: int) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size)
