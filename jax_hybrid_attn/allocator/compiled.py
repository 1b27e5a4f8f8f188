"""Ahead-of-time compiled allocator steps, with one task per operation on a CPU.

XLA's CPU compiler splits an operation into parallel tasks when its cost model counts enough bytes accessed: more
than 512 KB gives a memory-bound operation 2 tasks (at most ``ceil(sqrt(cores))``, and never more than the CPUs
the *compiling* thread may run on). The model counts the whole operand of a fused gather and the whole output of a
scatter, so each gather or scatter of a few hundred rows in a multi-MB state array (the pool's block info, the
request block tables, the prefix map, the token ids) runs as 2 tasks, and the hand-off to a pool thread costs
more than the copy: a 384-row gather from the [189,057, 8] block info took 56-75 µs split against 12-18 µs as one
task on the 2-core dev machine. The step has about 24 such operations in its common path.

`compile_single_task` compiles on a short-lived thread pinned to one CPU, so that XLA gives every memory-bound
operation one task (it still splits a fusion with more arithmetic than bytes: `step._idle_rows` keeps its
fusions under that threshold). Only that thread is pinned: the caller's affinity is never changed, and the
executable runs as any other (XLA's thread pool still runs independent operations side by side). The results
are the same bit for bit. On other platforms it is a plain ahead-of-time compile. Measured on 2 pinned cores of
the H200 host, alternating in two runs (`benchmarks/allocator_xla_flags.py`, RESULTS.md): the Gemma-3-like decode
step of 256 requests took 445-659 µs against 675-973 µs as `jax.jit` compiles it; 221 split operations became 9,
none of them in the common path.
"""

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import jax

from . import step as step_ops
from .state import AllocatorConfig, AllocatorState

__all__ = ["compile_allocate_slots", "compile_single_task"]


def compile_single_task(lowered: jax.stages.Lowered, *, platform: str) -> jax.stages.Compiled:
    """``lowered.compile()``; for ``platform="cpu"`` (where threads can be pinned) on a thread pinned to one CPU,
    so that XLA runs every operation as one task (see the module docstring)."""
    if platform != "cpu" or not hasattr(os, "sched_setaffinity"):
        return lowered.compile()

    def compile_pinned():
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        except OSError:  # a sandbox that forbids it: XLA's default split, still correct
            pass
        return lowered.compile()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jax_hybrid_attn-compile") as pool:
        return pool.submit(compile_pinned).result()


def _platform(state: AllocatorState) -> str:
    """Platform of the state's arrays (of the default backend for abstract ones without a sharding)."""
    leaf = state.pool.info
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return jax.default_backend()
    return next(iter(sharding.device_set)).platform


@functools.wraps(step_ops.allocate_slots.__wrapped__)  # its signature, for the static and donated names
def _allocate_slots(*args, **kwargs):
    return step_ops.allocate_slots.__wrapped__(*args, **kwargs)


# A jit of its own: JAX caches a lowering's executable, and `step.allocate_slots` may have compiled the same
# lowering without pinning; every executable cached here was compiled by `compile_allocate_slots`.
_single_task_step = jax.jit(
    _allocate_slots,
    static_argnames=("config", "num_tokens", "return_block_tables"),
    donate_argnames=("state", "previous_output"),
    keep_unused=True,
)


def compile_allocate_slots(
    config: AllocatorConfig,
    state: AllocatorState,
    *args,
    num_tokens: int | None = None,
    return_block_tables: bool = True,
    previous_output: step_ops.StepOutput | None = None,
) -> jax.stages.Compiled:
    """`step.allocate_slots` compiled ahead of time for these arguments (arrays or `jax.ShapeDtypeStruct`), with one
    task per operation on a CPU (`compile_single_task`). A second call for the same config, shapes and keywords
    returns the executable compiled by the first.

    Call the result with the arguments of `allocate_slots` less `config` and the static keywords (`num_tokens`,
    `return_block_tables`): ``step(state, slots, num_computed_tokens, num_new_tokens[, num_lookahead_tokens,
    full_sequence_must_fit][, previous_output=out])``, each with the shape and dtype it was compiled for (and
    `previous_output` given if and only if it was given here). `state` and `previous_output` are donated.

      >>> step = compile_allocate_slots(config, state, slots, computed, ones, num_tokens=256)
      >>> state, out = step(state, slots, computed, ones)
    """
    reused = {} if previous_output is None else {"previous_output": previous_output}
    lowered = _single_task_step.lower(
        config, state, *args, num_tokens=num_tokens, return_block_tables=return_block_tables, **reused
    )
    return compile_single_task(lowered, platform=_platform(state))
