"""The model runner: the one owner of an engine's device state and of its compiled step functions.

It holds the weights (laid out for scans over the layers, `ScannedDecoder`), the KV cache (every tensor of the
`KVCacheLayout` in one array), the allocator (`KVCacheManager`, whose state is the allocator's) and each request
slot's count of computed tokens; and the executables of a step's three calls (`device_step`): `allocate` and
`sample` (two variants each) and `forward` for every shape of `step_shapes`; with ``decode_steps`` > 1, also
`decode_steps` (greedy or not) for calls of several decode steps. `compile` builds all of them ahead of
time: the calls are lowered one after another (lowering holds Python's lock), or come lowered from a
`step_cache.StepLowering` (worker processes, the cache), while XLA compiles the ones that are ready in a thread
pool. After it, serving compiles nothing.

The engine calls it from one thread (its device worker), in order: `run_step` and the request operations.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..allocator import KVCacheManager
from ..models.config import ModelConfig
from ..models.layer_scan import ScannedDecoder
from ..models.partitioning import shard_model
from ..sharding import TENSOR_AXIS, kv_cache_spec, tensor_parallel_mesh
from .config import EngineConfig
from .device_step import StepPlan, allocate, decode_steps, forward, sample
from .kv_layout import KVCacheLayout
from .step_cache import StepLowering, flat_positions, load_step
from .step_shapes import StepShape, step_shapes

__all__ = ["CompileReport", "ModelRunner", "executable_keys"]

MAX_COMPILE_THREADS = 16
"""Executables XLA compiles at once in `ModelRunner.compile` (at most the host's cores)."""
CUBLAS_MATMUL_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}
"""XLA's options for the forward steps with ``EngineConfig.cublas_matmuls``: matmuls on cuBLAS, which reads an
operand at an offset into a larger buffer (a layer's weights in their stack) without a copy."""


def executable_keys(shapes: tuple[StepShape, ...], *, num_decode_steps: int = 1) -> list[tuple]:
    """Every executable of a step with these forward shapes, in compile order: ("allocate", defer_rest),
    ("forward", shape) per shape, ("sample", greedy_only), and with `num_decode_steps` > 1 ("decode_steps",
    (num_decode_steps, greedy_only))."""
    several = [("decode_steps", (num_decode_steps, greedy)) for greedy in (True, False)] if num_decode_steps > 1 else []
    return [("allocate", False), ("allocate", True), *(("forward", s) for s in shapes),
            ("sample", True), ("sample", False), *several]  # fmt: skip


def _stack_abstract(states):
    return jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype), *states)


def _abstract(tree):
    """`tree` with every array replaced by its `jax.ShapeDtypeStruct` (sharding included)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


@dataclasses.dataclass
class CompileReport:
    """What `ModelRunner.compile` did: the executables built, the seconds spent lowering (tracing included, on the
    calling thread) and in all, the seconds of the `ModelRunner.warm_up` that `Engine.compile` runs after it, and
    per executable its lowering and XLA compile seconds and, counted from the start, when its lowered module was
    ready and when its compile ended (`timeline`)."""

    executables: int = 0
    lowering_s: float = 0.0
    wall_s: float = 0.0
    warm_up_s: float = 0.0
    per_executable: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    timeline: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


class ModelRunner:
    """Weights, caches, allocator and compiled step functions of one engine (see the module docstring).

    Args:
      model: the `Decoder`; its layer weights are stacked into new arrays, their projections fused with
        ``config.fuse_projections`` (the decoder's weights stay as they are). An abstract one (`nnx.eval_shape`)
        makes a runner that only traces and lowers (nothing is allocated).
      model_config: its `ModelConfig`.
      config: the `EngineConfig`.
      max_model_len: the engine's resolved ``max_model_len``.
    """

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig, *, max_model_len: int):
        self.config = config
        self.mesh = tensor_parallel_mesh(config.tensor_parallel)
        self._replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        self.abstract = isinstance(jax.tree.leaves(nnx.state(model))[0], jax.ShapeDtypeStruct)
        if self.mesh is None:
            decoder, stack = model, _stack_abstract if self.abstract else None
        else:  # heads and MLP split over the mesh; everything else (allocator, metadata) replicated
            graphdef, state, _ = shard_model(model, self.mesh, TENSOR_AXIS)
            decoder, stack = nnx.merge(graphdef, state), self._stack_sharded
        # fused [q|k|v] and [gate|up] weights on one device only: split column-parallel, a shard would mix them
        fuse = config.fuse_projections and self.mesh is None
        self.model = ScannedDecoder.from_decoder(decoder, fuse_projections=fuse,
                                                 **({} if stack is None else {"stack": stack}))  # fmt: skip
        self.layout = KVCacheLayout.for_engine(
            model_config, config, max_model_len=max_model_len, dtype=model.dtype
        )
        self.allocator_config = self.layout.allocator_config(
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, enable_caching=config.enable_prefix_caching,
            sliding_window_in_window_only=config.sliding_window_in_window_only,
        )  # fmt: skip
        self.manager = KVCacheManager(self.allocator_config)
        if self.mesh is not None:
            self.manager.state = jax.device_put(self.manager.state, self._replicated)
        if self.abstract:  # a runner to lower the step functions with (`step_cache`), nothing allocated
            self.kv_cache = jax.ShapeDtypeStruct((self.layout.num_tensors, *self.layout.tensor_shape), self.layout.dtype)
        else:
            split = None if self.mesh is None else P(None, *kv_cache_spec(TENSOR_AXIS, self.layout.kv_layout))
            self.kv_cache = self.layout.allocate(None if split is None else NamedSharding(self.mesh, split))
        self.num_computed = jax.device_put(jnp.zeros(config.max_num_seqs, jnp.int32), self._replicated)
        self.shapes = step_shapes(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            cascade=config.cascade_step,
        )  # fmt: skip
        queries = (model_config.num_heads, model_config.head_dim, jnp.dtype(model.dtype).name)
        run_forward = partial(forward, self.layout, self.allocator_config, config.implementation, config.interpret,
                              mesh=self.mesh, axis=None if self.mesh is None else TENSOR_AXIS,
                              queries=queries)  # fmt: skip
        self._forward = jax.jit(run_forward, static_argnames=("num_tokens", "max_query_len", "cascade"),
                                donate_argnames=("kv_cache",))  # fmt: skip
        self._decode_steps = jax.jit(partial(decode_steps, self.allocator_config, run_forward),
                                     static_argnames=("num_steps", "num_tokens", "greedy_only"),
                                     donate_argnames=("allocator", "num_computed", "kv_cache"))  # fmt: skip
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._inputs: dict | None = None  # abstract inputs of the step's calls (`trace`)

    def _stack_sharded(self, states):
        """Stack layer states on a new leading axis, each leaf keeping its split over the mesh."""

        def stack(*leaves):
            sharding = NamedSharding(self.mesh, P(None, *leaves[0].sharding.spec))
            return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*leaves)

        return jax.tree.map(stack, *states)

    # ---------------------------------------------------------------------------------------- compiling

    @property
    def compiled(self) -> bool:
        return bool(self._executables)

    def executable_keys(self) -> list[tuple]:
        """`executable_keys` of this runner's shapes and ``decode_steps``."""
        return executable_keys(self.shapes, num_decode_steps=self.config.decode_steps)

    def call(self, key: tuple) -> tuple[Callable, tuple, tuple[int, ...]]:
        """Executable `key` (`executable_keys`) as (its function of the dynamic arguments, those arguments as
        abstract values of this runner's sizes, the positions of the donated ones)."""
        kind, variant = key
        inputs = self._abstract_inputs()
        config = self.allocator_config
        if kind == "allocate":
            return (partial(allocate, config, defer_rest=variant),
                    (inputs["allocator"], inputs["num_computed"], inputs["plan"]), (0,))  # fmt: skip
        if kind == "forward":
            return (partial(self._forward, num_tokens=variant.num_tokens, max_query_len=variant.max_query_len,
                            cascade=variant.cascade),
                    (inputs["model"], inputs["kv_cache"], inputs["out"]), (1,))  # fmt: skip
        if kind == "decode_steps":
            num_steps, greedy_only = variant
            return (partial(self._decode_steps, num_steps=num_steps, num_tokens=self.shapes[0].num_tokens,
                            greedy_only=greedy_only),
                    (inputs["allocator"], inputs["num_computed"], inputs["model"], inputs["kv_cache"],
                     inputs["plan"], inputs["row_steps"]), (0, 1, 3))  # fmt: skip
        return (partial(sample, config, greedy_only=variant),
                (inputs["allocator"], inputs["num_computed"], inputs["out"], inputs["known"], inputs["plan"],
                 inputs["logits"]), (0, 1))  # fmt: skip

    def trace(self, key: tuple) -> jax.stages.Traced:
        """The traced call of executable `key` on abstract inputs of this runner's sizes."""
        fn, args, _ = self.call(key)
        return fn.func.trace(*fn.args, *args, **fn.keywords)

    def _abstract_inputs(self) -> dict:
        if self._inputs is None:
            rows = self.config.max_num_seqs
            sharding = self._default_sharding()
            inputs = dict(
                plan=jax.ShapeDtypeStruct((len(StepPlan._fields), rows), np.int32, sharding=sharding),  # packed
                row_steps=jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding),
                allocator=_abstract(self.manager.state), num_computed=_abstract(self.num_computed),
                model=_abstract(self.model), kv_cache=_abstract(self.kv_cache),
            )  # fmt: skip
            self._inputs = inputs  # what the two traces below read; they add the rest
            _, inputs["out"], inputs["known"] = self.trace(("allocate", False)).out_info
            inputs["logits"] = self.trace(("forward", self.shapes[0])).out_info[1]
        return self._inputs

    def compile(
        self, *, progress: Callable[[str], None] | None = None, lowering: StepLowering | None = None
    ) -> CompileReport:
        """Compile every executable of a step ahead of time (`executable_keys`) and the allocator's request
        operations; `progress(name)` is called as each executable is ready.

        Lowering holds Python's lock: without `lowering`, it runs on this thread while XLA compiles what was
        lowered before in a pool of threads. With the `StepLowering` of this runner's spec, the step functions
        come as `jax.export` modules (from its cache or its worker processes), each compiled as it arrives."""
        report = CompileReport()
        started = time.perf_counter()
        keys = self.executable_keys()
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jha-compile") as pool:
            futures = {}

            def submit(key, blob=None):
                """Lower `key` (from its serialized step function, if given) and hand it to the pool."""
                t = time.perf_counter()
                if blob is None:
                    lowered, out_tree = self.trace(key).lower(), None
                else:
                    _, args, donated = self.call(key)
                    lowered, out_tree = load_step(blob, jax.tree.leaves(args), donate=flat_positions(args, donated))
                lowering_s = time.perf_counter() - t
                report.lowering_s += lowering_s
                ready = time.perf_counter() - started
                compiling = pool.submit(self._compile_one, lowered, self.compiler_options(key))
                futures[key] = (lowering_s, ready, out_tree, compiling)

            if lowering is None:
                for key in keys:
                    submit(key)
            else:
                for key, blob in lowering.results(self):
                    submit(key, blob)
            self.manager.compile()
            for key in keys:
                lowering_s, ready, out_tree, future = futures[key]
                compiled, compile_s, done = future.result()
                self._executables[key] = compiled if out_tree is None else _FlatCall(compiled, out_tree)
                report.per_executable[executable_name(key)] = (lowering_s, compile_s)
                report.timeline[executable_name(key)] = (ready, done - started)
                report.executables += 1
                if progress is not None:
                    progress(executable_name(key))
        report.wall_s = time.perf_counter() - started
        return report

    def warm_up(self) -> float:
        """Run every executable once on an idle plan (`StepPlan.idle`), which changes no state, and wait for it;
        returns its seconds. On a GPU an executable's first run loads its kernels and sets up its buffers: this
        pays that before serving instead of in the first steps of the first requests."""
        if not self._executables:
            raise RuntimeError("ModelRunner.compile() must run before warm_up()")
        started = time.perf_counter()
        rows = self.config.max_num_seqs
        plan = StepPlan.idle(rows)
        for shape in self.shapes:  # every forward, after one variant of allocate and before one of sample
            self.run_step(plan, shape, defer_rest=False, greedy_only=True)
        self.run_step(plan, self.shapes[0], defer_rest=True, greedy_only=False)  # their other variants
        for kind, variant in self._executables:
            if kind == "decode_steps":
                num_steps, greedy_only = variant
                self.run_decode_steps(plan, np.zeros(rows, np.int32), num_steps=num_steps, greedy_only=greedy_only)
        jax.block_until_ready((self.manager.state, self.num_computed, self.kv_cache))
        return time.perf_counter() - started

    def compiler_options(self, key: tuple) -> dict:
        """XLA's options for executable `key`: `CUBLAS_MATMUL_OPTIONS` for those that run the model with
        ``cublas_matmuls``, else none."""
        kind, _ = key
        runs_the_model = kind in ("forward", "decode_steps")
        return dict(CUBLAS_MATMUL_OPTIONS) if runs_the_model and self.config.cublas_matmuls else {}

    @staticmethod
    def _compile_one(lowered: jax.stages.Lowered, options: dict) -> tuple[jax.stages.Compiled, float, float]:
        """(the executable compiled with XLA's `options`, its compile seconds, when it ended)."""
        t = time.perf_counter()
        compiled = lowered.compile(options or None)
        done = time.perf_counter()
        return compiled, done - t, done

    def _default_sharding(self):
        if self._replicated is not None:
            return self._replicated
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    # ------------------------------------------------------------------------------------------ serving

    def run_step(self, plan: StepPlan, shape: StepShape, *, defer_rest: bool, greedy_only: bool) -> jax.Array:
        """Send one step's three calls (nothing is read back): allocate, forward at `shape`, sample. The state
        becomes their outputs; returns the `StepResult` packed in one device array (`StepResult.unpacked`)."""
        if not self._executables:
            raise RuntimeError("ModelRunner.compile() must run before the first step")
        plan = jax.device_put(plan.packed(), self._default_sharding())  # one transfer
        allocator, out, known = self._executables["allocate", defer_rest](
            self.manager.state, self.num_computed, plan
        )
        self.manager.state = allocator
        self.kv_cache, logits = self._executables["forward", shape](self.model, self.kv_cache, out)
        self.manager.state, self.num_computed, result = self._executables["sample", greedy_only](
            self.manager.state, self.num_computed, out, known, plan, logits
        )
        return result

    def run_decode_steps(self, plan: StepPlan, row_steps: np.ndarray, *, num_steps: int,
                         greedy_only: bool) -> jax.Array:  # fmt: skip
        """Send one call of `num_steps` decode steps, row r in the first `row_steps[r]` ([R]) of them
        (`device_step.decode_steps`; nothing is read back). The state becomes its outputs; returns the steps'
        packed `StepResult`s stacked on a leading axis (one device array)."""
        if ("decode_steps", (num_steps, greedy_only)) not in self._executables:
            raise RuntimeError(f"no executable of {num_steps} decode steps (EngineConfig.decode_steps="
                               f"{self.config.decode_steps})")  # fmt: skip
        plan, row_steps = jax.device_put((plan.packed(), row_steps), self._default_sharding())
        self.manager.state, self.num_computed, self.kv_cache, results = self._executables[
            "decode_steps", (num_steps, greedy_only)
        ](self.manager.state, self.num_computed, self.model, self.kv_cache, plan, row_steps)
        return results


class _FlatCall:
    """A compiled step function of flat arguments (`step_cache`), called as the function it was exported from."""

    def __init__(self, compiled: jax.stages.Compiled, out_tree):
        self.compiled, self.out_tree = compiled, out_tree

    def __call__(self, *args):
        return jax.tree.unflatten(self.out_tree, self.compiled(*jax.tree.leaves(args)))


def executable_name(key: tuple) -> str:
    """The name of executable `key` (`executable_keys`) in compile reports and progress lines."""
    kind, variant = key
    labels = {"allocate": {False: "allocate", True: "allocate (defer rest)"},
              "sample": {True: "sample (greedy)", False: "sample"}}  # fmt: skip
    if kind == "decode_steps":
        num_steps, greedy_only = variant
        return f"{num_steps} decode steps{' (greedy)' if greedy_only else ''}"
    return f"forward {variant}" if kind == "forward" else labels[kind][variant]
