"""Workarounds for XLA's CPU runtime, in one place, each with what it buys.

The XLA CPU runtime pays a few microseconds per operation (a thunk dispatch each), so the allocator step costs
about its number of array operations, whatever the batch size. The step is written to keep that number low and to
avoid copies of the multi-MB state arrays; the device-neutral code elsewhere calls these helpers instead of the
plain JAX operations. Every helper gives the same values, bit for bit, as the plain operation would. The
measured figures are in ``benchmarks/RESULTS.md`` (the allocator's step sections):

* `compile_single_task` (the pinned compile; `kv_cache_manager.compile_allocate_slots` compiles the step with it). XLA's CPU compiler splits an operation
  into parallel tasks when its cost model counts enough bytes accessed: more than 512 KB gives a memory-bound
  operation 2 tasks (at most ``ceil(sqrt(cores))``, and never more than the CPUs the *compiling* thread may run
  on). The model counts the whole operand of a fused gather and the whole output of a scatter, so each gather or
  scatter of a few hundred rows in a multi-MB state array (the pool's block info, the request block tables, the
  prefix map, the token ids) runs as 2 tasks, and the hand-off to a pool thread costs more than the copy. The
  step has about 24 such operations in its common path. Compiling on a thread pinned to one CPU makes XLA give every
  memory-bound operation one task (it still splits a fusion with more arithmetic than bytes; see `materialize`).
  Only that thread is pinned: the caller's affinity is never changed, and the executable runs as any other (XLA's
  thread pool still runs independent operations side by side). On the Gemma-3-like decode step of 256 requests
  it leaves a few operations split, none of them in the common path, and the step runs faster than as `jax.jit`
  compiles it.
* `cumsum`: an int32 prefix sum as two reduce-windows (up to 1,024 elements), where XLA's CPU lowering of
  `jnp.cumsum` takes about seven operations.
* `run_if`: rarely needed work as a 0-or-1-trip `lax.while_loop`. A `lax.cond` whose pass-through branch returns
  large operands makes XLA copy them on the CPU; a loop updates its carry in place, so the state arrays are never
  copied.
* `run_or_select`: `run_if` on the CPU; on a GPU the work always runs and a select keeps its result when needed,
  for work cheap beside the host sync that a loop's predicate costs there (it waits for the step in flight).
* `cpu_cond`: a check whose general branch is a few cheap operations runs unconditionally on a GPU (where a
  `lax.cond` costs a host sync of its predicate, more than the branch) and behind a `lax.cond` on the CPU (where
  the shortcut saves the branch's block-sized arrays).
* `materialize` (an optimization barrier): computes a value once. Without it XLA fuses a gather into each of its
  consumers and repeats it; and one fusion reading many columns can get more operations than bytes, which the
  CPU cost model counts ten times as compute and splits over 2 tasks even under the pinned compile.
* `updated`: sets a few entries of a small vector as elementwise selects, which XLA fuses into their consumers; a
  chain of ``.at[i].set`` is a dynamic-update-slice each, with copies in between (an operation each).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from ..integers import cdiv

__all__ = [
    "compile_single_task",
    "cpu_cond",
    "cumsum",
    "materialize",
    "run_and_select",
    "run_if",
    "run_or_select",
    "updated",
]


# ------------------------------------------------------------------------------------------ array operations


def materialize(x):
    """Compute `x` once: XLA does not fuse it into its consumers (see the module docstring)."""
    return jax.lax.optimization_barrier(x)


def updated(vector, values: dict):
    """`vector` (1-D, e.g. `BlockPool.counters`) with ``vector[i] = values[i]`` for each i, as elementwise selects."""
    index = jnp.arange(vector.shape[0])
    for i, value in values.items():
        vector = jnp.where(index == i, value, vector)
    return vector


def run_if(pred, fn, *operands):
    """``fn(*operands)`` if `pred` else `operands`, as a 0-or-1-trip `lax.while_loop` (updated in place)."""

    def body(carry):
        return False, fn(*carry[1])

    return jax.lax.while_loop(lambda carry: carry[0], body, (pred, operands))[1]


def run_and_select(pred, fn, *operands):
    """``fn(*operands)`` if `pred` else `operands`, without control flow: `fn` always runs, a select keeps its
    results or the operands."""
    results = fn(*operands)
    return jax.tree.map(lambda new, old: jnp.where(pred, new, old), tuple(results), operands)


def run_or_select(pred, fn, *operands):
    """``fn(*operands)`` if `pred` else `operands`: `run_if` on the CPU, `run_and_select` elsewhere (on a GPU
    the device then never waits on the host for `pred`)."""
    return jax.lax.platform_dependent(
        cpu=lambda: run_if(pred, fn, *operands), default=lambda: run_and_select(pred, fn, *operands)
    )


def cpu_cond(pred, general_fn, shortcut_fn):
    """``general_fn()``, except on the CPU, where ``shortcut_fn()`` runs instead when `pred` is False.

    Both functions must return the same values whenever `pred` is False.
    """
    return jax.lax.platform_dependent(
        cpu=lambda: jax.lax.cond(pred, general_fn, shortcut_fn), default=general_fn
    )


CUMSUM_TILE = 16
"""`cumsum` sums tiles of this many elements with one window, then the tile totals with another."""


def cumsum(x):
    """Inclusive int32 prefix sum of a 1-D array: two reduce-windows up to 1,024 elements; larger arrays (ring
    compaction) recurse, a factor `CUMSUM_TILE` per level."""
    x = jnp.asarray(x, jnp.int32)
    n = x.shape[0]
    if n <= CUMSUM_TILE:
        return jax.lax.reduce_window(x, 0, jax.lax.add, (n,), (1,), ((n - 1, 0),))
    rows = cdiv(n, CUMSUM_TILE)
    tiles = jnp.pad(x, (0, rows * CUMSUM_TILE - n)).reshape(rows, CUMSUM_TILE)
    inner = jax.lax.reduce_window(
        tiles, 0, jax.lax.add, (1, CUMSUM_TILE), (1, 1), ((0, 0), (CUMSUM_TILE - 1, 0))
    )
    totals = inner[:, -1]
    if rows <= 4 * CUMSUM_TILE:  # one quadratic window over the tile totals
        outer = jax.lax.reduce_window(totals, 0, jax.lax.add, (rows,), (1,), ((rows - 1, 0),)) - totals
    else:
        outer = cumsum(totals) - totals
    return (inner + outer[:, None]).reshape(-1)[:n]


# -------------------------------------------------------------------------------------------- pinned compile


def compile_single_task(lowered: jax.stages.Lowered, *, platform: str) -> jax.stages.Compiled:
    """``lowered.compile()``; for ``platform="cpu"`` (where threads can be pinned) on a thread pinned to one CPU,
    so that XLA runs every memory-bound operation as one task (see the module docstring). The results are the same
    bit for bit; on other platforms this is a plain ahead-of-time compile."""
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
