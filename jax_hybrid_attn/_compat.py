"""The JAX calls whose spelling changes between releases, in one place (pinned: jax 0.11.2).

When the pin moves, this module is the one to re-check: `register_dataclass` field arguments,
the Mosaic GPU import path and interpret-mode parameters (public from 0.11.1),
`jax.nn.dot_product_attention`'s `local_window_size`, and the Mosaic GPU lowering that
`share_identical_kernels` wraps.
"""

import os

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "register_pytree_dataclass",
    "plgpu",
    "interpret_params",
    "check_interpret_threads",
    "races_found",
    "dense_attention",
    "share_identical_kernels",
]


def register_pytree_dataclass(cls, *, data_fields: list[str], meta_fields: list[str]):
    """Register a dataclass as a pytree: `data_fields` are traced leaves, `meta_fields` static."""
    return jax.tree_util.register_dataclass(cls, data_fields=data_fields, meta_fields=meta_fields)


def interpret_params(*, detect_races: bool = False) -> "plgpu.InterpretGPUParams":
    """Mosaic GPU interpret mode on the CPU; uninitialized memory reads as NaN so stray reads show."""
    return plgpu.InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")


def resolve_interpret(interpret) -> "plgpu.InterpretGPUParams | None":
    """`interpret` as the kernels take it: False (compile for the GPU), True, or explicit parameters."""
    if interpret is True:
        return interpret_params()
    if interpret is False or interpret is None:
        return None
    if not isinstance(interpret, plgpu.InterpretGPUParams):
        raise ValueError(f"interpret={interpret!r} must be a bool or plgpu.InterpretGPUParams")
    return interpret


INTERPRET_CPU_THREADS = 8
"""Threads the CPU client needs for interpret mode: one per warpgroup of a CTA, each blocked in callbacks."""


def check_interpret_threads() -> None:
    """Refuse interpret mode when the CPU client's thread pool is too small for warp-specialized kernels.

    Interpret mode runs each warpgroup of a CTA as a thread whose barrier waits block one of the CPU
    client's pool threads. The pool has one thread per core, so on a 2-core machine a producer and two
    consumers starve it and hang. `PJRT_NPROC` sets the pool size; it is read when the CPU backend
    starts, so it must be set before the first JAX computation.
    """
    threads = int(os.environ.get("PJRT_NPROC", 0)) or os.cpu_count() or 1
    if threads < INTERPRET_CPU_THREADS:
        raise RuntimeError(
            f"Mosaic GPU interpret mode needs at least {INTERPRET_CPU_THREADS} CPU client threads, this machine "
            f"gives {threads}: set os.environ['PJRT_NPROC'] = '{INTERPRET_CPU_THREADS}' (or the environment "
            "variable) before the first JAX computation"
        )


def races_found() -> bool:
    """Whether interpret mode with ``detect_races=True`` saw a data race (a private API in 0.11.2)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return interpret_pallas_call.get_races().races_found


def dense_attention(q, k, v, *, scale: float, is_causal: bool, local_window_size):
    """`jax.nn.dot_product_attention` on [batch, seq, heads, head_dim] inputs, XLA implementation."""
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, local_window_size=local_window_size, implementation="xla"
    )


MOSAIC_GPU_DUMP_NAME = "mosaic_gpu.dump_basename"
"""The attribute Pallas stamps on each Mosaic GPU module: a per-process counter-numbered name for debug dumps."""


def share_identical_kernels() -> None:
    """Let a Mosaic GPU kernel lowered in several step functions compile once per process (idempotent).

    jaxlib compiles each Mosaic GPU kernel once per process, keyed by a hash of its serialized module, one kernel
    at a time (a lock), seconds each. But the Pallas lowering stamps every module with a new name for debug dumps
    (`MOSAIC_GPU_DUMP_NAME`: "anonymous_2", "anonymous_6", ...), so the same kernel lowered into two step shapes
    hashes apart and compiles twice. This wraps the lowering (a private function in 0.11.2) to drop that name
    before the module is hashed; jaxlib names it again when it compiles it, for its dumps."""
    from jax._src.interpreters import mlir
    from jax.experimental.mosaic.gpu import core as mosaic_core

    lowering = mosaic_core._mosaic_gpu_lowering_rule
    if getattr(lowering, "_drops_dump_name", False):
        return

    def content_addressed(ctx, *args, module, **kwargs):
        attributes = module.operation.attributes
        if MOSAIC_GPU_DUMP_NAME in attributes:
            del attributes[MOSAIC_GPU_DUMP_NAME]
        return lowering(ctx, *args, module=module, **kwargs)

    content_addressed._drops_dump_name = True
    mosaic_core._mosaic_gpu_lowering_rule = content_addressed  # what Pallas' `pallas_call` lowering calls
    mlir.register_lowering(mosaic_core.mosaic_gpu_p, content_addressed, "cuda")
