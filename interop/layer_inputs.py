"""How one layer call's torch tensors become its JAX inputs, for `PagedAttentionBackend.run`.

* q, k and v that are the column blocks of one [T, (N + 2K) * H] tensor (vLLM splits its QKV projection output
  into such views, which are not compact, so DLPack could not take them one by one) enter JAX as that tensor and
  are split inside the jitted call (`fused_qkv`, `split_fused_qkv`).
* A step's token count rounded up to a power of two (`plan.pack_plan`) is reached with zero rows (`padded_rows`).
* A tensor's memory is named by its device, address, shape and dtype (`tensor_key`), to reuse what XLA wrote in
  place.

Shape letters: T tokens · N query heads · K kv heads · H head size.
"""

import math

import jax
import torch

__all__ = ["FUSED", "fused_qkv", "padded_rows", "split_fused_qkv", "tensor_key"]


class _Fused:
    """Passed as k and v when q is the fused [T, (N + 2K) * H] tensor of all three (static under jit)."""

    def __repr__(self):
        return "FUSED"


FUSED = _Fused()
jax.tree_util.register_static(_Fused)


def fused_qkv(q, k, v, shape, kv_shape, *, dtypes) -> torch.Tensor | None:
    """The [T, (N + 2K) * H] tensor whose column blocks q ([T, N, H] `shape`, or flat), k and v ([T, K, H]
    `kv_shape`, or flat) are, or None. Only for tensors of one of `dtypes`."""
    tensors = (q, k, v)
    if not all(isinstance(x, torch.Tensor) for x in tensors) or q.dtype not in dtypes:
        return None
    if len({(x.dtype, x.device, x.untyped_storage().data_ptr()) for x in tensors}) != 1:
        return None
    num_tokens = shape[0]
    widths = (math.prod(shape[1:]), math.prod(kv_shape[1:]), math.prod(kv_shape[1:]))
    row = sum(widths)
    offset = q.storage_offset()
    for x, x_shape, width in zip(tensors, (shape, kv_shape, kv_shape), widths):
        if x.dim() == 2:
            expected_shape, expected_strides = (num_tokens, width), (row, 1)
        else:
            expected_shape, expected_strides = x_shape, (row, x_shape[2], 1)
        if tuple(x.shape) != expected_shape or x.stride() != expected_strides or x.storage_offset() != offset:
            return None
        offset += width
    return torch.as_strided(q, (num_tokens, row), (row, 1), q.storage_offset())


def split_fused_qkv(qkv: jax.Array, *, num_kv_heads: int, head_size: int) -> tuple[jax.Array, ...]:
    """[T, (N + 2K) * H] -> q [T, N, H], k and v [T, K, H] (traceable: slices inside the jitted call)."""
    kv_width = num_kv_heads * head_size
    q_width = qkv.shape[1] - 2 * kv_width
    parts = (qkv[:, :q_width], qkv[:, q_width : q_width + kv_width], qkv[:, q_width + kv_width :])
    return tuple(part.reshape(qkv.shape[0], -1, head_size) for part in parts)


def padded_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with `rows` rows: itself, or a zero-padded copy (the step's token count rounded up)."""
    if tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def tensor_key(tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's memory for reuse: device, address, shape, dtype."""
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
