"""What a `jax.profiler` trace says about a run: the GPU's busy time, and where the host spent its time.

    summary = profiled(directory, run)    # run() under the profiler (Python tracer off), then `summarize`
    summary.gpu_busy_ms, summary.gpu_span_ms, summary.gpu_ops, summary.host_ms_by_name, summary.gpu_by_kind,
    summary.idle_by_gap, summary.host_calls_by_name

Shared by the benchmarks in this folder; it reads the Perfetto trace (``*.trace.json.gz``) that
``jax.profiler.trace(..., create_perfetto_trace=True)`` writes.
"""

import bisect
import collections
import dataclasses
import glob
import gzip
import json
import re
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    """gpu_busy_ms: time in which some GPU stream runs a kernel or a copy; gpu_span_ms: from the first of them to
    the last; gpu_ops: how many ran; host_ms_by_name: total duration of each host event name (its own time and
    the time of what it calls, so nested names overlap), largest first; gpu_by_kind: kernels and copies grouped by
    `kernel_kind`, each (count, ms), largest time first; idle_by_gap: the span's idle time by the length of the
    gap between one operation and the next (`GAP_CLASSES_US`: launch gaps, short waits, the host), each (count,
    ms); host_calls_by_name: how many events of each host name. NaN and zero counts where the trace has no GPU (a
    CPU dry run)."""

    gpu_busy_ms: float
    gpu_span_ms: float
    gpu_ops: int
    host_ms_by_name: dict[str, float]
    gpu_by_kind: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    idle_by_gap: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    host_calls_by_name: dict[str, int] = dataclasses.field(default_factory=dict)

    def host_lines(self, *, per: int = 1, top: int = 12) -> list[str]:
        """The `top` host event names, each as "name: count x, ms" divided by `per` (e.g. per call)."""
        return [f"{name}: {self.host_calls_by_name.get(name, 0) / per:.0f}x {ms / per:.3f} ms"
                for name, ms in list(self.host_ms_by_name.items())[:top]]  # fmt: skip

    def idle_lines(self, *, per: int = 1) -> list[str]:
        """Idle time by gap length, each as "gaps < 10 us: count x, ms" divided by `per` (e.g. per step)."""
        return [f"gaps {label}: {count / per:.0f}x {ms / per:.3f} ms"
                for label, (count, ms) in self.idle_by_gap.items()]  # fmt: skip

    def kernel_lines(self, *, per: int = 1, top: int = 12) -> list[str]:
        """The `top` kinds of GPU operation, each as "kind: count x, ms" divided by `per` (e.g. per step)."""
        return [f"{kind}: {count / per:.0f}x {ms / per:.3f} ms"
                for kind, (count, ms) in list(self.gpu_by_kind.items())[:top]]  # fmt: skip


GAP_CLASSES_US = (10.0, 100.0)
"""Bounds of the idle gaps `summarize` tells apart: under 10 us the GPU moves from one launch to the next (the
launch gap of a stream with work queued), 10-100 us a short wait (a host callback, a copy to the host), beyond
that the GPU waited for the host to send work."""


def _gap_label(index: int) -> str:
    bounds = GAP_CLASSES_US
    if index == 0:
        return f"< {bounds[0]:g} us"
    if index == len(bounds):
        return f">= {bounds[-1]:g} us"
    return f"{bounds[index - 1]:g}-{bounds[index]:g} us"


def kernel_kind(name: str) -> str:
    """A GPU operation's name without what numbers its instances (``loop_add_fusion_12`` -> ``loop_add_fusion``;
    template arguments and Mosaic's suffixes dropped), so that one kind of kernel is counted together."""
    name = name.split("<", 1)[0].split("(", 1)[0]
    return re.sub(r"(_\d+)+$|\.\d+$", "", name) or name


def load_events(directory: str) -> list[dict]:
    """The events of the one Perfetto trace under `directory`."""
    (path,) = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as file:
        events = json.load(file)
    return events["traceEvents"] if isinstance(events, dict) else events


def summarize(events: list[dict]) -> TraceSummary:
    names = {(e["pid"], e.get("tid"), e["name"]): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M"}  # fmt: skip
    processes = {pid: name for (pid, _, kind), name in names.items() if kind == "process_name"}
    gpu_pids = {pid for pid, name in processes.items() if "GPU" in name}
    host_pids = {pid for pid, name in processes.items() if "host" in name.lower()}
    streams = {(pid, tid) for (pid, tid, kind), name in names.items()  # kernels and copies, not module or op lines
               if pid in gpu_pids and kind == "thread_name" and name.startswith("Stream")}  # fmt: skip
    complete = [e for e in events if e.get("ph") == "X"]
    gpu_events = [e for e in complete if (e["pid"], e["tid"]) in streams]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu_events)
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu_events:
        kind = kinds[kernel_kind(e["name"])]
        kind[0] += 1
        kind[1] += e["dur"] / 1e3
    by_kind = {name: (count, ms) for name, (count, ms) in sorted(kinds.items(), key=lambda item: -item[1][1])}
    host, host_calls = collections.Counter(), collections.Counter()
    for e in complete:
        if e["pid"] in host_pids:
            host[e["name"]] += e["dur"] / 1e3
            host_calls[e["name"]] += 1
    host_ms = dict(host.most_common())
    if not spans:
        return TraceSummary(float("nan"), float("nan"), 0, host_ms, host_calls_by_name=dict(host_calls))
    busy, end = 0.0, spans[0][0]
    gaps = [[0, 0.0] for _ in range(len(GAP_CLASSES_US) + 1)]  # per gap class: count, ms
    for start, stop in spans:
        if start > end:
            gap = gaps[bisect.bisect_right(GAP_CLASSES_US, start - end)]
            gap[0] += 1
            gap[1] += (start - end) / 1e3
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    idle_by_gap = {_gap_label(i): (count, ms) for i, (count, ms) in enumerate(gaps)}
    return TraceSummary(busy / 1e3, (end - spans[0][0]) / 1e3, len(spans), host_ms, by_kind, idle_by_gap,
                        dict(host_calls))  # fmt: skip


def profiled(directory: str, run: Callable[[], None]) -> TraceSummary:
    """`summarize` the trace of `run()` under the profiler (Python tracer off: it would slow the host side)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(directory, create_perfetto_trace=True, profiler_options=options):
        run()
    return summarize(load_events(directory))
