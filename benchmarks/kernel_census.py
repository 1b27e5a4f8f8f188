"""Kernels per layer of the engine's steps, counted in the compiled executables: nothing runs, nothing is profiled.

Run from the repository root:

  PYTHONPATH=.:benchmarks python benchmarks/kernel_census.py [--sections engine,attention]
      [--engine-variant FIELD=INT,...] [--json PATH]

On a GPU it compiles for the GPU attached. On a CPU it compiles for an H200 without one (XLA's deviceless
compilation: `H200_TARGET`), once the CUDA plugin is installed beside jax (BUILD.md, "Counting kernels without a
GPU"): the same HLO passes and fusion decisions as on the device, but no autotuning, so a matmul may get another
tiling (or go to cuBLAS) there.

The model and sizes are those of `serving.py --sections busy`: the Gemma-3-1B shape, 256 sequences, blocks of 16,
an 8,192-token budget. Per step it counts the launches of each executable the engine calls: a decode step's
allocate, forward (every row one token) and greedy sample, and a prefill step's forward (8,192 tokens); and the
allocator's calls that admit and finish a batch of requests (`add_requests`, `free`). A launch is
an instruction of the optimized module that starts work on the GPU (a fusion, a custom call: a Mosaic GPU kernel
or a cuBLAS call, a copy, an asynchronous slice), times the trip count of every loop around it. A profile
(`serving.py --sections busy`, CUPTI) counts a few more: cuBLAS may run two kernels per call and a copy's driver
its own. ``--engine-variant`` (repeatable) adds the engine with those `EngineConfig` fields changed, e.g.
``--engine-variant cublas_matmuls=0``. Section ``attention``: the launches of one `paged_attention` call of
each decode workload of `roofline.py` in `ATTENTION_WORKLOADS` (the kernel and the small XLA kernels around it).

Prints a table of launches per executable (and per layer for a forward) by kind, and writes the rows as JSON
(``--json PATH``, default benchmarks/kernel_census.json).
"""

import argparse
import collections
import dataclasses
import hashlib
import pickle
import re
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import SingleDeviceSharding

from jax_hybrid_attn import paged_attention
from jax_hybrid_attn.allocator import init_state
from jax_hybrid_attn.allocator import requests as request_ops
from jax_hybrid_attn.allocator import step as step_ops
from jax_hybrid_attn.allocator.request_batches import RequestBatches
from jax_hybrid_attn.engine import EngineConfig
from jax_hybrid_attn.engine.model_runner import executable_name
from jax_hybrid_attn.engine.step_cache import MOSAIC_GPU_CALL, RunnerSpec, export_step
from jax_hybrid_attn.kernels.mixed_batch import lowering_for_sms, num_sms
from jax_hybrid_attn.models.config import ModelConfig
from results_json import write_sections
from serving import GEMMA3_1B, parse_engine_variant, variant_label

H200_SMS = 132
H200_TARGET = f"""
gpu_device_info {{
  cuda_compute_capability {{ major: 9 minor: 0 }}
  core_count: {H200_SMS}
  fpus_per_core: 128
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150323855360
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 19 }}
device_description_str: "NVIDIA H200"
"""
"""An H200 as XLA's GPU compiler sees it (a `stream_executor.GpuTargetConfigProto` in text form): compute
capability 9.0, 132 SMs, 228 KiB of shared memory per SM (227 KiB per block), 64k registers, 4.8 TB/s, a 50 MiB
L2, 1.98 GHz, 141 GB."""

SIZES = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
"""The engine of `serving.py --sections busy`."""
ATTENTION_WORKLOADS = ("D0", "F1", "D2", "F2")
"""The decode workloads of `roofline.py` whose single attention calls `--sections attention` counts."""
NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency", "domain", "fusion-done", "copy-done", "async-done",
             "while", "conditional", "call"}  # fmt: skip
"""Instructions that launch nothing themselves (loops, branches and calls are counted through their bodies)."""
KINDS = (  # (kind, what the launch's label matches), first match wins
    ("attention (Mosaic GPU)", r"mosaic_gpu"),
    ("matmul", r"gemm|cublas|__custom_fusion:"),  # a custom fusion: cuBLAS reading a slice in place
    ("slice or copy", r"^fusion-start|^copy|dynamic.slice|slice_fusion|^wrapped_slice|^wrapped_concatenate"),
    ("scatter (K/V write)", r"scatter"),
    ("concatenate", r"concatenate"),
    ("norm or reduction (Triton)", r"__triton:"),
    ("elementwise or reduction (XLA)", r"."),
)


@dataclasses.dataclass(frozen=True)
class Census:
    """The launches of one executable: per label (a fusion's name stem and kind, a custom call's target, an
    opcode), how many per call; loops whose trip count depends on the data (the allocator's) counted once each.
    `host_syncs`: the loops of a data-dependent trip count and the branches that run on every call (once per trip
    of the known-count loops around them; not those inside another such loop or branch): on a GPU each reads its
    condition back to the host, so the host waits for the device there."""

    launches: dict[str, int]
    host_syncs: int = 0

    @property
    def total(self) -> int:
        return sum(self.launches.values())

    def by_kind(self) -> dict[str, int]:
        kinds = collections.Counter()
        for label, count in self.launches.items():
            kinds[next(kind for kind, pattern in KINDS if re.search(pattern, label))] += count
        return dict(kinds)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The optimized module's computations (name -> instruction lines) and the entry's name."""
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            computations[current].append(line.strip())
    return computations, entry


def _label(line: str, opcode: str) -> str:
    if opcode == "custom-call":
        return "custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
    if opcode != "fusion":
        return opcode
    name = re.match(r"^(?:ROOT )?%([\w.\-]+) =", line).group(1)
    stem = re.sub(r"(\.\d+|\.clone)+$", "", name)
    backend = re.search(r'"kind":"([\w$]+)"', line)  # a Triton or custom fusion's kind, else XLA's
    kind = backend.group(1) if backend else re.search(r"kind=(\w+)", line).group(1)
    return f"{stem} ({kind}:)"


def census(text: str) -> Census:
    """Count the launches of an optimized HLO module (`jax.stages.Compiled.as_text`): every instruction that
    launches work, times the known trip count of each while loop around it (one iteration of a loop whose
    count depends on the data); of a conditional, its largest branch."""
    computations, entry = _computations(text)
    launches = collections.Counter()
    syncs = [0]

    def count(name: str, times: int, into: collections.Counter, *, every_call: bool = True) -> None:
        for line in computations[name]:
            found = re.match(r"^(?:ROOT )?%[\w.\-]+ = .*? ([\w\-]+)\(", line)
            if found is None:
                continue
            opcode = found.group(1)
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = 1 if trips is None else int(trips.group(1))  # a data-dependent loop: one iteration
                syncs[0] += times if trips is None and every_call else 0
                inside = every_call and trips is not None
                count(re.search(r"body=%([\w.\-]+)", line).group(1), times * n, into, every_call=inside)
                count(re.search(r"condition=%([\w.\-]+)", line).group(1), times * (n + 1), into, every_call=inside)
            elif opcode == "conditional":
                syncs[0] += times if every_call else 0
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                         re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line))  # fmt: skip
                counted = []
                for branch in names:
                    counted.append(collections.Counter())
                    count(branch, times, counted[-1], every_call=False)
                into.update(max(counted, key=lambda c: sum(c.values())))
            elif opcode == "call":
                count(re.search(r"to_apply=%([\w.\-]+)", line).group(1), times, into, every_call=every_call)
            elif opcode not in NO_LAUNCH:
                into[_label(line, opcode)] += times

    count(entry, 1, launches)
    return Census(dict(launches), syncs[0])


def compile_target():
    """(the device to compile for, its description): the GPU attached, else an H200 compiled for on this CPU."""
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        return device, device.device_kind
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET, topology="1x1x1")
    except Exception as error:  # no CUDA plugin, or one that cannot compile without a device
        raise SystemExit(f"no GPU here and no deviceless CUDA compiler ({error}); install the CUDA plugin "
                         "(BUILD.md, 'Counting kernels without a GPU')") from error  # fmt: skip
    return topology.devices[0], "NVIDIA H200 (compiled without a device, on a CPU)"


def step_executables(runner) -> list[tuple[str, tuple]]:
    """(step, executable key) of each executable the engine calls for a decode step (allocate, the forward of
    one token per row, the greedy sample) and the forward of a whole prefill step, as the engine sends them when
    no step before deferred rows (`ModelRunner.executable_keys`; a prefill step's allocation is the decode step's),
    and the allocation of a step that serves every row (after deferred rows, or admitting a possible prefix hit)."""
    forward = {key[1]: key for key in runner.executable_keys() if key[0] == "forward" and not key[1].cascade}
    decode = next(key for shape, key in forward.items() if shape.max_query_len == 1)
    prefill = max(forward.values(), key=lambda key: key[1].num_tokens)
    return [("decode and prefill", ("allocate", True)), ("decode", decode), ("decode", ("sample", True)),
            ("prefill", prefill), ("serving every row", ("allocate", False))]


_CENSUSES: dict[tuple[bytes, str], tuple[Census, float]] = {}
"""`compile_census`'s results by lowered module and XLA options: an executable that a variant leaves as it was
(the allocator's, say) is compiled once."""


def target_sms() -> int:
    """The SM count the kernels are traced for (their grids): the attached GPU's, else the H200's."""
    return num_sms() if jax.default_backend() == "gpu" else H200_SMS


def compiled_census(exported: export.Exported, leaves, device, options: dict) -> tuple[Census, float]:
    """(the census of `exported`, a `jax.export` module of flat arguments like `leaves`, compiled for `device`
    with XLA's `options`, its compile seconds)."""
    sharding = SingleDeviceSharding(device)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves]
    started = time.perf_counter()
    compiled = jax.jit(exported.call).trace(*abstract).lower().compile(options or None)
    return census(compiled.as_text()), time.perf_counter() - started


def compile_census(runner, key: tuple, device) -> tuple[Census, float]:
    """(the census of executable `key` of `runner` compiled for `device`, its compile seconds): lowered for CUDA
    as the engine's worker processes lower it (`export_step`), compiled with the runner's options."""
    blob = export_step(runner, key, platform="cuda")
    options = runner.compiler_options(key)
    memo = (hashlib.sha256(blob).digest(), repr(sorted(options.items())))
    if memo not in _CENSUSES:
        _, args, _ = runner.call(key)
        exported = export.deserialize(pickle.loads(blob)["exported"])
        _CENSUSES[memo] = compiled_census(exported, jax.tree.leaves(args), device, options)
    return _CENSUSES[memo]


def run(variant: dict, device, rows: list) -> None:
    """Append a row per executable of `step_executables` of the engine of `variant` (`EngineConfig` fields)."""
    model_config = ModelConfig.from_hf(GEMMA3_1B)
    config = EngineConfig(**SIZES, **variant).resolved(platform="gpu")
    label = variant_label(variant) or "default"
    with lowering_for_sms(target_sms()):
        spec = RunnerSpec.of_config(model_config, config, SIZES["max_model_len"], dtype=jnp.bfloat16,
                                    param_dtype=jnp.bfloat16)  # fmt: skip
        runner = spec.abstract_runner()
        for step, key in step_executables(runner):
            result, seconds = compile_census(runner, key, device)
            name = executable_name(key)
            per_layer = result.total / model_config.num_layers if key[0] == "forward" else None
            print(f"{label} | {step} | {name}: {result.total} launches"
                  + ("" if per_layer is None else f", {per_layer:.1f} per layer")
                  + f", {result.host_syncs} host syncs; compiled in {seconds:.1f} s",
                  flush=True)  # fmt: skip
            rows.append(dict(engine=label, step=step, executable=name, launches=result.total, per_layer=per_layer,
                             by_kind=result.by_kind(), by_label=result.launches,
                             host_syncs=result.host_syncs, compile_s=seconds))  # fmt: skip
        if not variant:  # the allocator's calls do not change with the model's variants
            for name, result, seconds in request_batch_census(runner, device):
                print(f"{label} | requests | {name}: {result.total} launches, {result.host_syncs} host syncs; "
                      f"compiled in {seconds:.1f} s", flush=True)  # fmt: skip
                rows.append(dict(engine=label, step="requests", executable=name, launches=result.total,
                                 per_layer=None, by_kind=result.by_kind(), by_label=result.launches,
                                 host_syncs=result.host_syncs, compile_s=seconds))  # fmt: skip


def request_batch_census(runner, device) -> list[tuple[str, Census, float]]:
    """(name, census, compile seconds) of the allocator's calls that admit and finish requests (`add_requests`,
    `free`; `RequestBatches`) at the largest batch the engine sends, for `device`."""
    config = runner.allocator_config
    size = RequestBatches(config).sizes[-1]
    ints = jax.ShapeDtypeStruct((size,), jnp.int32)
    state = jax.eval_shape(lambda: init_state(config))
    calls = {
        f"add_requests ({size} prompts)": (partial(request_ops.add_requests, config),
                                           (state, ints, jax.ShapeDtypeStruct((size, config.max_model_len),
                                                                              jnp.int32),
                                            ints, jax.ShapeDtypeStruct((size, 2), jnp.uint32), ints)),
        f"free ({size} requests)": (partial(step_ops.free, config), (state, ints)),
    }  # fmt: skip
    results = []
    for name, (function, args) in calls.items():
        leaves, tree = jax.tree.flatten(args)
        exported = export.export(jax.jit(lambda *xs, f=function: f(*jax.tree.unflatten(tree, xs))),
                                 platforms=["cuda"])(*leaves)  # fmt: skip
        results.append((name, *compiled_census(exported, leaves, device, {})))
    return results


def attention_calls(device) -> list[dict]:
    """A row per decode workload of `roofline.py` in `ATTENTION_WORKLOADS`: the launches of one jitted
    `paged_attention` call on the kernels, as the roofline times it (its wall time against its kernels' time)."""
    import roofline

    rows = []
    for workload in roofline.workloads(False):
        if workload.id not in ATTENTION_WORKLOADS:
            continue
        with lowering_for_sms(target_sms()):
            leaves, tree = jax.tree.flatten(jax.eval_shape(lambda w=workload: roofline.inputs(w, 0)))

            def call(*leaves, w=workload):
                q, kv_cache, metadata, sinks = jax.tree.unflatten(tree, leaves)
                return paged_attention(q, kv_cache, metadata, **roofline.options(w, sinks), implementation="kernel")

            unchecked = [export.DisabledSafetyCheck.custom_call(MOSAIC_GPU_CALL)]
            exported = export.export(jax.jit(call), platforms=["cuda"], disabled_checks=unchecked)(*leaves)
        result, _ = compiled_census(exported, leaves, device, {})
        print(f"attention | {workload.id} {workload.name}: {result.total} launches", flush=True)
        rows.append(dict(workload=workload.id, name=workload.name, launches=result.total, by_kind=result.by_kind(),
                         by_label=result.launches))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="engine,attention")
    parser.add_argument("--engine-variant", action="append", default=[],
                        help="EngineConfig fields changed, FIELD=INT,... (repeatable)")  # fmt: skip
    parser.add_argument("--json", default=str(Path(__file__).with_name("kernel_census.json")))
    args = parser.parse_args()
    sections = args.sections.split(",")
    device, target = compile_target()
    kinds = [kind for kind, _ in KINDS]
    results = {}
    if "engine" in sections:
        rows = []
        for variant in ({}, *map(parse_engine_variant, args.engine_variant)):
            run(variant, device, rows)
        results["census"] = rows
    if "attention" in sections:
        results["attention_calls"] = attention_calls(device)
    print(f"\nLaunches per call, {target}, jax {jax.__version__}")
    if "census" in results:
        print("Engine, Gemma-3-1B shape (26 layers); loops of a data-dependent trip count (the allocator's) once")
        print("| engine | step | executable | launches | per layer | host syncs | "
              + " | ".join(kinds) + " |")
        print("|---|---|---|---|---|---|" + "---|" * len(kinds))
        for row in results["census"]:
            per_layer = "" if row["per_layer"] is None else f"{row['per_layer']:.1f}"
            cells = " | ".join(str(row["by_kind"].get(kind, 0)) for kind in kinds)
            print(f"| {row['engine']} | {row['step']} | {row['executable']} | {row['launches']} | {per_layer} | "
                  f"{row['host_syncs']} | {cells} |")  # fmt: skip
    if "attention_calls" in results:
        print("\n| attention call | launches | " + " | ".join(kinds) + " |")
        print("|---|---|" + "---|" * len(kinds))
        for row in results["attention_calls"]:
            cells = " | ".join(str(row["by_kind"].get(kind, 0)) for kind in kinds)
            print(f"| {row['workload']} {row['name']} | {row['launches']} | {cells} |")
    write_sections(args.json, results, target=target)


if __name__ == "__main__":
    main()
