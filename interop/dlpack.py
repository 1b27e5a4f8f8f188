"""Zero-copy tensors between torch and JAX through DLPack, with the checks DLPack itself does not make.

Facts this module relies on (jax 0.11.2, torch 2.11, measured on the CPU and the H200):

* A compact tensor (contiguous, or a permutation of contiguous such as ``t.T``) is shared, not copied, both ways,
  on the CPU and on a GPU. A sliced tensor (non-compact strides) is refused by JAX even with ``copy=True``.
* With x64 off, JAX silently turns an int64 or float64 tensor into an int32 or float32 *copy*. `to_jax` refuses
  those dtypes instead; convert on the torch side (``t.to(torch.int32)``), where the cost is visible.
* A misaligned data pointer (a view at an odd offset) is silently copied on the CPU and fails at the first jitted
  use on a GPU. `to_jax` refuses pointers that are not `ALIGNMENT`-byte aligned.
* Stream order, torch -> JAX: JAX hands its stream to ``tensor.__dlpack__``; torch records an event on its
  **current** stream and JAX's stream waits on it. Writes that torch queued on another stream are not covered:
  convert inside ``torch.cuda.stream(s)`` for the stream that wrote, or synchronize first.
* Stream order, JAX -> torch: ``torch.from_dlpack`` passes torch's current stream and JAX makes it wait for the
  computation that produces the array; torch work queued after `to_torch` on that stream sees the result.
* Nothing orders *later* writes: torch must not overwrite a tensor that a queued JAX computation still reads
  (and JAX refuses to donate a buffer that torch still holds).
"""

import jax
import jax.numpy as jnp
import torch
from jax._src import xla_bridge  # version-sensitive (jax 0.11.2): `_import` falls back to jax.dlpack
from jax._src.lib import _jax as _jaxlib

from jax_hybrid_attn.integers import check_int

__all__ = ["ALIGNMENT", "check_shareable", "is_compact", "jax_dtype", "same_memory", "to_jax", "to_torch"]

ALIGNMENT = 16
"""Bytes: XLA requires device buffers aligned to 16 bytes ("Address of buffer must be a multiple of 0x10")."""


def is_compact(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill one dense block of memory in some axis order (what JAX accepts)."""
    if tensor.is_contiguous():  # the common case, answered by torch at no Python cost
        return True
    order = sorted(range(tensor.dim()), key=lambda axis: tensor.stride(axis))
    expected = 1
    for axis in order:
        if tensor.shape[axis] == 1:
            continue
        if tensor.stride(axis) != expected:
            return False
        expected *= tensor.shape[axis]
    return True


def to_jax(
    tensor: torch.Tensor,
    *,
    name: str = "tensor",
    copy: bool = False,
    alignment: int = ALIGNMENT,
    already_ordered: bool = False,
) -> jax.Array:
    """The torch tensor as a JAX array sharing its memory.

    Args:
      tensor: a compact torch tensor on the CPU or a CUDA device, of a dtype JAX keeps as is.
      name: how errors name the tensor.
      copy: if the tensor is not compact, make it so with ``tensor.contiguous()`` (a copy, on torch's current
        stream) instead of raising.
      alignment: bytes the data pointer must be a multiple of (at least `ALIGNMENT`; Mosaic GPU kernel operands
        need 256).
      already_ordered: an earlier import whose array goes to the same jitted call already made JAX wait for
        torch's current stream, after the work that produced this tensor: the array then carries no event of its
        own. (An ordered import makes torch record an event, JAX's stream wait on it and JAX record a definition
        event that the jitted call then waits on: host time at the import and again in the call, per array; see
        benchmarks/RESULTS.md.) Only for tensors whose producing work was queued before that import and not
        changed since, used by the same call.

    Raises:
      ValueError: not a dense tensor in memory (`check_shareable`), not compact (and ``copy=False``), a dtype JAX
        would silently narrow, or a misaligned pointer.
    """
    check_shareable(tensor, name)
    check_int("alignment", alignment)
    if tensor.numel() and not is_compact(tensor):
        if not copy:
            raise ValueError(
                f"{name} with shape {tuple(tensor.shape)} and strides {tensor.stride()} is not compact (a slice?): "
                "DLPack cannot share it with JAX; pass copy=True or call .contiguous() first"
            )
        tensor = tensor.contiguous()
    if tensor.dtype in (torch.int64, torch.float64, torch.complex128) and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{name}.dtype={tensor.dtype}: JAX (x64 off) would silently copy it to 32 bits; convert it on the "
            "torch side first, e.g. .to(torch.int32)"
        )
    if tensor.numel() and tensor.data_ptr() % max(alignment, ALIGNMENT):
        raise ValueError(
            f"{name}.data_ptr()={tensor.data_ptr():#x} is not {max(alignment, ALIGNMENT)}-byte aligned (a view at an "
            "offset?): JAX would copy it (CPU) or fail (GPU); pass an aligned tensor, e.g. .clone()"
        )
    return _import(tensor, already_ordered=already_ordered)


def check_shareable(tensor, name: str) -> None:
    """`ValueError` naming `tensor` unless it is a dense torch tensor whose memory holds its values as they read:
    not one that requires grad (JAX would not see its gradient), nor a negated or conjugated view (its memory
    holds the values without the sign or conjugation), nor a quantized, sparse, nested or meta tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.requires_grad:
        raise ValueError(f"{name} requires grad: pass tensor.detach() (JAX computes no gradient for torch)")
    if tensor.is_neg():
        raise ValueError(f"{name} is a negated view: its memory holds the values unnegated; pass tensor.resolve_neg()")
    if tensor.is_conj():
        raise ValueError(f"{name} is a conjugated view: its memory holds them unconjugated; pass tensor.resolve_conj()")
    if tensor.is_quantized:
        raise ValueError(f"{name} is quantized ({tensor.dtype}): pass tensor.dequantize()")
    if tensor.is_nested:
        raise ValueError(f"{name} is a nested tensor: pass its components one by one")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} has layout {tensor.layout}: pass tensor.to_dense()")
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it has no memory to share")


def _import(tensor: torch.Tensor, *, already_ordered: bool = False) -> jax.Array:
    """`jax.dlpack.from_dlpack` without most of its per-call Python overhead (benchmarks/RESULTS.md): the device
    and JAX's stream are looked up once per torch device, and the dtype needs no canonicalizing (`to_jax` refused
    the dtypes that would). Falls back to the public function if jaxlib's entry point moves."""
    dl_device = tensor.__dlpack_device__()
    target = _DLPACK_TARGETS.get(dl_device)
    if target is None:
        target = _DLPACK_TARGETS[dl_device] = _dlpack_target(*dl_device)
    device, stream = target
    if _managed_tensor_to_buffer is None or device is None:
        return jax.dlpack.from_dlpack(tensor)
    dl_type = int(dl_device[0])
    if already_ordered or stream is None:  # no event on either side: JAX takes the buffer as ready
        return _managed_tensor_to_buffer(tensor.__dlpack__(stream=NO_STREAM_SYNC), device, None, None, dl_type)
    return _managed_tensor_to_buffer(tensor.__dlpack__(stream=stream), device, stream, None, dl_type)


def _dlpack_target(dl_device_type: int, device_id: int):
    """(JAX device, stream for torch's ready event) of a DLPack device, as `jax.dlpack.from_dlpack` finds them."""
    platform = {1: "cpu", 2: "gpu"}.get(int(dl_device_type))
    if platform is None:
        return None, None
    device = xla_bridge.get_backend(platform).device_from_local_hardware_id(device_id)
    try:
        stream = device.get_stream_for_external_ready_events()
    except jax.errors.JaxRuntimeError as error:  # the CPU has no streams
        if "UNIMPLEMENTED" not in str(error):
            raise
        stream = None
    return device, stream


_DLPACK_TARGETS: dict = {}
NO_STREAM_SYNC = -1
"""`torch.Tensor.__dlpack__`'s stream value for "no synchronization" (DLPack's convention)."""
_managed_tensor_to_buffer = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)


SUB_BYTE_DTYPES = frozenset(
    jnp.dtype(getattr(jnp, name)) for name in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn") if hasattr(jnp, name)
)
"""JAX dtypes of fewer than 8 bits: no DLPack type describes them."""


def to_torch(array: jax.Array, *, name: str = "array") -> torch.Tensor:
    """The JAX array as a torch tensor sharing its memory (torch's current stream waits for the array).

    The array keeps an external reference while the tensor lives: JAX then refuses to donate it.
    """
    if not isinstance(array, jax.Array):
        raise ValueError(f"{name} must be a jax.Array, got {type(array).__name__}")
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name} holds PRNG keys ({array.dtype}): export jax.random.key_data({name}) instead")
    if jnp.dtype(array.dtype) in SUB_BYTE_DTYPES:
        raise ValueError(f"{name}.dtype={array.dtype} packs values below a byte, which DLPack cannot describe: "
                         f"convert it first, e.g. {name}.astype(jnp.int8)")  # fmt: skip
    if array.is_deleted():
        raise ValueError(f"{name} was deleted (donated to a jitted call?) and cannot be exported")
    return torch.from_dlpack(array)


def same_memory(tensor: torch.Tensor, array: jax.Array) -> bool:
    """Whether the two share their first byte (how tests and benchmarks show that nothing was copied)."""
    return tensor.data_ptr() == array.unsafe_buffer_pointer()


def jax_dtype(dtype: torch.dtype) -> jnp.dtype:
    """The JAX dtype that DLPack maps a torch dtype to."""
    return jnp.dtype(str(dtype).removeprefix("torch."))
