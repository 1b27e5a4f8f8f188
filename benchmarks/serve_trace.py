"""`jha serve` with a timeline, for `serve_load.py --trace`: the same server, with times recorded where a request
passes (``time.perf_counter``, one clock for every process of the machine) and written as JSON lines to
``$JHA_SERVE_TRACE_DIR``:

  server.jsonl   one line per `RequestStreams.open` (its time and request count) and per delivery of a step's
                 events (its time and event count), written when the server stops;
  engine.jsonl   one line per engine step (start, end, requests scheduled and tokens computed, running and
                 waiting requests after it) and per `add_request`, written whenever the engine falls idle;

and in each, one line per garbage collection that took over `GC_RECORD_S` (start, end, generation).

Run as `python benchmarks/serve_trace.py serve ...` (the arguments of ``jha serve``).
"""

import atexit
import functools
import gc
import json
import os
import sys
import time

TRACE_DIR_VARIABLE = "JHA_SERVE_TRACE_DIR"
GC_RECORD_S = 1e-3


def _writer(name: str):
    records: list[dict] = []
    path = os.path.join(os.environ[TRACE_DIR_VARIABLE], name)

    def flush() -> None:
        with open(path, "a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)
        records.clear()

    return records, flush


def _record_collections(records: list[dict]) -> None:
    started = {}

    def callback(phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            started["t"] = now
        elif now - started.get("t", now) > GC_RECORD_S:
            records.append({"kind": "gc", "start": started["t"], "end": now, "generation": info["generation"]})

    gc.callbacks.append(callback)


def traced_build(args, *, log=sys.stderr):
    """`server.build_engine`, with the engine's `add_request` and `step` timed (in the engine process)."""
    from jax_hybrid_attn.serve.server import build_engine

    engine, tokenizer = build_engine(args, log=log)
    records, flush = _writer("engine.jsonl")
    _record_collections(records)
    add_request, step, schedule = engine.add_request, engine.step, engine.scheduler.schedule
    scheduled: list = []

    def traced_add(*a, **k):
        records.append({"kind": "add", "t": time.perf_counter()})
        return add_request(*a, **k)

    def traced_schedule():
        rows = schedule()
        scheduled[:] = [len(rows), sum(work.num_tokens for _, work in rows)]
        return rows

    def traced_step(*a, **k):
        scheduled[:] = [0, 0]
        start = time.perf_counter()
        finished = step(*a, **k)
        records.append({"kind": "step", "start": start, "end": time.perf_counter(), "rows": scheduled[0],
                        "tokens": scheduled[1], "running": len(engine.scheduler.running),
                        "waiting": len(engine.scheduler.waiting)})  # fmt: skip
        if not engine.has_unfinished_requests():
            flush()
        return finished

    engine.add_request, engine.step, engine.scheduler.schedule = traced_add, traced_step, traced_schedule
    return engine, tokenizer


def main() -> None:
    from jax_hybrid_attn import cli
    from jax_hybrid_attn.serve import request_streams, server
    from jax_hybrid_attn.serve.engine_process import EngineProcess

    records, flush = _writer("server.jsonl")
    atexit.register(flush)
    _record_collections(records)
    open_streams, deliver = request_streams.RequestStreams.open, request_streams.RequestStreams._deliver

    def traced_open(self, requests):
        records.append({"kind": "open", "t": time.perf_counter(), "n": len(requests)})
        return open_streams(self, requests)

    def traced_deliver(self, events):
        records.append({"kind": "deliver", "t": time.perf_counter(), "n": len(events)})
        return deliver(self, events)

    request_streams.RequestStreams.open, request_streams.RequestStreams._deliver = traced_open, traced_deliver
    server.EngineProcess = functools.partial(EngineProcess, build=traced_build)
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
