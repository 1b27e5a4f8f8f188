"""`jha serve` under load, like `vllm bench serve`: clients stream completions from a server in another process,
then `Engine.generate` runs the same prompts in this process for the tokens/s beside it.

Run from the repository root:  PYTHONPATH=. python benchmarks/serve_load.py [--tiny] [--request-rate 16]

  1. the checkpoint: `--model DIR`, or (as benchmarks/startup.py writes it) a Gemma-3-1B-shaped transformers
     checkpoint with random bf16 weights (`--tiny`: the small shape of benchmarks/serving.py, for a CPU dry run);
     the prompts are startup.py's text prompts (`--num-prompts` of 128-1,023 bytes; tiny: 16-63);
  2. `jha serve` starts as a subprocess on 127.0.0.1 with the engine flags of startup.py's newcomer command at
     the server's own token budget, `SERVE_GPU_STEP_TOKENS` (tiny: small sizes), and the clock starts once
     ``/health`` says 200 (its startup is reported apart);
  3. `--num-prompts` streaming requests (greedy, `--max-tokens` each, EOS ignored) are sent at `--request-rate`
     per second with Poisson arrivals (seeded), or all at once (``inf``, the default), at most
     `--max-concurrency` in flight, from `--client-processes` processes (one Python process cannot parse 256
     streams as fast as the server sends them), each request on a new connection (`--warm-connections`: on
     connections each client opened before the clock started); each records its time to first token, the gaps
     between its chunks and its end-to-end latency. The clients are aiohttp's, as `vllm bench serve`'s are:
     httpx's take about three times as long to put a burst of requests on the wire;
  4. the server's /metrics (preemptions, prefix-cache hit rate) is read and the server stopped;
  5. `Engine.generate` on the same prompts, with the same engine flags, in this process (a warm run after one
     that compiles); its greedy text is compared with the server's.

Prints one line per measurement and a table last: request throughput, output tokens/s, total tokens/s, TTFT, ITL
and end-to-end latency (p50, p90, p99, in ms), and the engine's own tokens/s on the same prompts.
"""

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from serve_trace import TRACE_DIR_VARIABLE
from serving import GEMMA3_1B, TINY
from startup import NEWCOMER_FLAGS, write_checkpoint, write_prompts

from jax_hybrid_attn.serve import SERVE_GPU_STEP_TOKENS

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
PROMPT_BYTES = (128, 1024)
TINY_PROMPT_BYTES = (16, 64)
TINY_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "256"]
SERVE_FLAGS = ["--max-num-seqs", "256", "--max-num-batched-tokens", str(SERVE_GPU_STEP_TOKENS),
               "--max-model-len", "2048"]
"""startup.py's newcomer flags at `jha serve`'s budget, given to both runs: `Engine.generate` steps as the server."""
HEALTH_TIMEOUT_S = 1800  # a cold compile on a busy machine
HEALTH_POLL_S = 0.5
CLIENT_START_S = 0.5  # from the client processes' import to the first request
WARM_CLIENT_START_S = 3.0  # the same, opening every connection first (--warm-connections)
DEFAULT_CLIENT_PROCESSES = 4
REQUEST_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
PERCENTILES = (50, 90, 99)
PREFIX = "jha:"  # the server's metric names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, flags: list[str], *, port: int, log_path: str, profile: str | None = None,
                 trace: str | None = None) -> tuple[subprocess.Popen, float]:  # fmt: skip
    """`jha serve` in a subprocess (under cProfile, writing `profile`, if given; with `serve_trace`'s timeline
    written to the directory `trace`, if given); returns it once /health says 200, with the seconds that took."""
    import httpx

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if trace:
        env[TRACE_DIR_VARIABLE] = trace
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    entry = [str(Path(__file__).with_name("serve_trace.py"))] if trace else ["-m", "jax_hybrid_attn"]
    command = [sys.executable, *profiler, *entry, "serve", "--model", model_dir, "--port",
               str(port), "--log-level", "warning", *flags]  # fmt: skip
    started = time.perf_counter()
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it until it stops
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    while time.perf_counter() - started < HEALTH_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"jha serve exited ({process.returncode}):\n{Path(log_path).read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process, time.perf_counter() - started
        except httpx.TransportError:
            pass
        time.sleep(HEALTH_POLL_S)
    stop_server(process)
    raise RuntimeError(f"jha serve was not healthy after {HEALTH_TIMEOUT_S} s")


def stop_server(process: subprocess.Popen) -> None:
    """Stop the server as Ctrl-C does (uvicorn shuts down, then raises the signal again: a SIGINT lets cProfile
    write its file, a SIGTERM would not)."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def one_request(session, prompt: str, *, model: str, max_tokens: int) -> dict:
    """One streaming completion: its text, output tokens, TTFT, chunk gaps and end-to-end latency (seconds)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    times, text, usage = [], [], None
    async with session.post("/v1/completions", json=body) as response:
        if response.status != 200:
            return {"error": f"{response.status}: {(await response.text())[:200]}"}
        async for raw in response.content:  # one server-sent-event line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"]:
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"text": "".join(text), "output_tokens": usage["completion_tokens"] if usage else len(times),
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "ttft": times[0] - started if times else None, "itl": list(np.diff(times)), "e2e": end - started,
            "start": started, "end": end}  # fmt: skip


async def _client(base: str, prompts: list[tuple[int, str, float]], *, model: str, max_tokens: int,
                  max_concurrency: int | None, start_at: float,
                  warm_connections: bool) -> list[tuple[int, dict]]:  # fmt: skip
    """One client process's share: each (index, prompt, send offset in s) sent at ``start_at + offset``; with
    `warm_connections`, over connections opened before (one ``GET /health`` each, kept alive)."""
    import aiohttp

    connections = max_concurrency or len(prompts) or 1
    limit = asyncio.Semaphore(connections)
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as client:
        if warm_connections:
            await asyncio.gather(*(_health(client) for _ in range(min(connections, len(prompts)))))

        async def send(index, prompt, offset):
            await asyncio.sleep(max(0.0, start_at + offset - time.perf_counter()))
            async with limit:
                return index, await one_request(client, prompt, model=model, max_tokens=max_tokens)

        return await asyncio.gather(*(send(*item) for item in prompts))


async def _health(session) -> None:
    async with session.get("/health") as response:
        await response.read()


def _client_process(base, prompts, kwargs) -> list[tuple[int, dict]]:
    return asyncio.run(_client(base, prompts, **kwargs))


def _ready() -> None:
    import aiohttp  # noqa: F401 - imported before the clock starts


def run_load(base: str, prompts: list[str], *, model: str, max_tokens: int, rate: float,
             max_concurrency: int | None, seed: int, processes: int,
             warm_connections: bool = False) -> tuple[list[dict], float, float]:  # fmt: skip
    """Send every prompt (Poisson arrivals at `rate` per second, or all at once for inf) from `processes` client
    processes (prompt i from process i mod `processes`), so that parsing the streams is not the bottleneck;
    (results in prompt order, wall seconds from the first send to the last response's end, the first send's
    time)."""
    import concurrent.futures
    import multiprocessing

    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(prompts)) if math.isinf(rate) else np.cumsum(rng.exponential(1.0 / rate, len(prompts)))
    shares = [[(i, prompts[i], float(offsets[i])) for i in range(p, len(prompts), processes)] for p in range(processes)]
    per_process = None if max_concurrency is None else max(1, math.ceil(max_concurrency / processes))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        for future in [pool.submit(_ready) for _ in range(processes)]:
            future.result()
        start_at = time.perf_counter() + (WARM_CLIENT_START_S if warm_connections else CLIENT_START_S)
        kwargs = {"model": model, "max_tokens": max_tokens, "max_concurrency": per_process, "start_at": start_at,
                  "warm_connections": warm_connections}  # fmt: skip
        futures = [pool.submit(_client_process, base, share, kwargs) for share in shares if share]
        results = dict(item for future in futures for item in future.result())
    ends = [r["end"] for r in results.values() if "end" in r]
    return [results[i] for i in range(len(prompts))], (max(ends) if ends else time.perf_counter()) - start_at, start_at


def scrape(base: str) -> dict[str, float]:
    import httpx

    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def ms(values) -> str:
    if not len(values):
        return "-"
    return " / ".join(f"{np.percentile(values, p) * 1e3:.1f}" for p in PERCENTILES)


def report(label: str, results: list[dict], wall: float, before: dict, after: dict, direct: dict, record) -> None:
    """One load's lines: outcome, throughput (against `Engine.generate`'s on the second load's prompts),
    latencies as the clients saw them, and the server's own counters over the load."""
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    same = sum(r.get("text") == t for r, t in zip(results, direct["texts"], strict=True))

    def delta(name: str) -> float:
        return after.get(f"{PREFIX}{name}", 0.0) - before.get(f"{PREFIX}{name}", 0.0)

    direct_output = direct["output_tokens"] / direct["seconds"]
    record(f"{label} | {len(ok)} ok, {len(errors)} failed" + (f" ({errors[0]})" if errors else "") + f" | "
           f"{wall:.2f} s | {len(ok) / wall:.2f} req/s | output {output_tokens / wall:,.0f} tok/s "
           f"({output_tokens / wall / direct_output:.0%} of Engine.generate's) | total "
           f"{(prompt_tokens + output_tokens) / wall:,.0f} tok/s")  # fmt: skip
    record(f"{label} | latency ms p50/p90/p99 | TTFT {ms([r['ttft'] for r in ok if r['ttft'] is not None])} | "
           f"ITL {ms([g for r in ok for g in r['itl']])} | E2E {ms([r['e2e'] for r in ok])}")  # fmt: skip
    first_tokens = delta("time_to_first_token_seconds_count")
    mean_ttft = delta("time_to_first_token_seconds_sum") / max(1.0, first_tokens)
    record(f"{label} | server's counters | mean TTFT from submission {mean_ttft * 1e3:.1f} ms "
           f"| engine steps {delta('engine_steps_total'):.0f} | preemptions {delta('num_preemptions_total'):.0f} | "
           f"prefix-cache hits {delta('prefix_cache_hit_tokens_total'):.0f} of {delta('prompt_tokens_total'):.0f} "
           f"prompt tokens" + (f" | greedy text equal to Engine.generate's {same}/{len(results)}"
                               if label == "second load" else ""))  # fmt: skip


def _read_trace(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file]


def print_timeline(label: str, trace: str, results: list[dict], *, start: float, wall: float) -> None:
    """Where one load's time went (ms from its first send): the clients' sends, the server's submissions, the
    engine's `add_request`s and steps (busy, idle between steps, each step of the first 20 and the last), the
    server's last delivery and the clients' last end."""
    end = start + wall + 1.0
    server = [r for r in _read_trace(os.path.join(trace, "server.jsonl"))
              if start - 1.0 <= r.get("t", r.get("start")) <= end]  # fmt: skip
    engine = _read_trace(os.path.join(trace, "engine.jsonl"))
    adds = sorted(r["t"] for r in engine if r["kind"] == "add" and start - 1.0 <= r["t"] <= end)
    steps = sorted((r for r in engine if r["kind"] == "step" and start <= r["start"] <= end), key=lambda r: r["start"])

    def at(t: float) -> str:
        return f"{(t - start) * 1e3:.0f}"

    def spread(times: list[float]) -> str:
        if not times:
            return "-"
        return f"first {at(min(times))}, median {at(float(np.median(times)))}, last {at(max(times))}"

    opens = [r["t"] for r in server if r["kind"] == "open"]
    delivers = [r["t"] for r in server if r["kind"] == "deliver"]
    print(f"timeline | {label} | ms from the first send")
    print(f"  client sends: {spread([r['start'] for r in results if 'start' in r])}")
    print(f"  server submissions: {len(opens)}, {spread(opens)}")
    print(f"  engine add_request: {len(adds)}, {spread(adds)}")
    if steps:
        busy = sum(s["end"] - s["start"] for s in steps)
        idle = sum(max(0.0, b["start"] - a["end"]) for a, b in itertools.pairwise(steps))
        print(f"  engine steps: {len(steps)}, first starts at {at(steps[0]['start'])}, last ends at "
              f"{at(steps[-1]['end'])}; in step() {busy * 1e3:.0f} ms, between steps {idle * 1e3:.0f} ms")  # fmt: skip
        for i, s in enumerate(steps):
            if i < 20 or i == len(steps) - 1:
                print(f"    step {i}: {at(s['start'])} +{(s['end'] - s['start']) * 1e3:.1f} ms, {s['rows']} rows, "
                      f"{s['tokens']} tokens; then running {s['running']}, waiting {s['waiting']}")  # fmt: skip
    print(f"  server deliveries: {len(delivers)}, last {at(max(delivers)) if delivers else '-'}; clients' last end "
          f"{at(start + wall)}")  # fmt: skip
    for name, records in (("server", server), ("engine", engine)):
        pauses = [r for r in records if r["kind"] == "gc" and start <= r["start"] <= end]
        print(f"  {name} process: {len(pauses)} garbage collections over 1 ms, "
              + ", ".join(f"{at(r['start'])} +{(r['end'] - r['start']) * 1e3:.0f} ms (gen {r['generation']})"
                          for r in pauses[:12]))  # fmt: skip


def _reset_engine(engine) -> None:
    """(In the engine process.) Forget the prefix cache and the counters, as `engine_generate` does."""
    engine.reset()


def engine_process(model_dir: str, flags: list[str], prompts: list[str], *, max_tokens: int) -> dict:
    """The server's engine process without HTTP: every prompt submitted at once from an event loop (as the
    server's handlers submit them) and read back to the end, warm (a first round runs once, then the prefix cache
    is reset)."""
    from jax_hybrid_attn.cli import build_parser
    from jax_hybrid_attn.engine import SamplingParams
    from jax_hybrid_attn.models import load_tokenizer
    from jax_hybrid_attn.serve.engine_loop import EngineRequest
    from jax_hybrid_attn.serve.engine_process import EngineProcess
    from jax_hybrid_attn.serve.request_streams import RequestStreams

    args = build_parser().parse_args(["serve", "--model", model_dir, "--log-level", "warning", *flags])
    tokenizer = load_tokenizer(model_dir)
    token_lists = [tokenizer.encode(p) for p in prompts]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = EngineProcess(args).start()
    engine.wait_loaded()

    async def run(tag: str) -> float:
        streams = RequestStreams(engine)
        requests = [EngineRequest(f"{tag}-{i}", tokens, sampling) for i, tokens in enumerate(token_lists)]
        started = time.perf_counter()
        events = streams.open(requests)
        left = len(requests)
        while left:
            event = await events.get()
            left -= event.finish_reason is not None or event.error is not None
        return time.perf_counter() - started

    async def both() -> float:
        engine.start()  # read the engine's messages on this loop
        while not engine.ready.is_set():
            if engine.error is not None:
                raise engine.error
            await asyncio.sleep(HEALTH_POLL_S)
        await run("warm")
        await asyncio.wrap_future(engine.when_idle(_reset_engine))  # no prefix hits from the warm round
        return await run("timed")

    try:
        return {"seconds": asyncio.run(both())}
    finally:
        engine.stop()


def engine_generate(model_dir: str, flags: list[str], prompts: list[str], *, max_tokens: int) -> dict:
    """`Engine.generate` on the prompts with the server's engine flags, warm (a first run compiles)."""
    from jax_hybrid_attn.cli import build_parser
    from jax_hybrid_attn.engine import SamplingParams
    from jax_hybrid_attn.serve.server import build_engine

    args = build_parser().parse_args(["serve", "--model", model_dir, *flags])
    engine, tokenizer = build_engine(args, log=sys.stderr)
    token_lists = [tokenizer.encode(p) for p in prompts]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(token_lists, sampling)  # compiles every step shape, warms nothing else up
    engine.reset()
    token_times: dict = {}

    def on_token(request_id, _token) -> None:
        token_times.setdefault(request_id, []).append(time.perf_counter())

    started = time.perf_counter()
    outputs = engine.generate(token_lists, sampling, on_token=on_token)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "texts": [tokenizer.decode(o.output_token_ids) for o in outputs],
            "output_tokens": sum(len(o.output_token_ids) for o in outputs),
            "prompt_tokens": sum(map(len, token_lists)), "steps": engine.stats.steps,
            "ttft": [times[0] - started for times in token_times.values()],
            "itl": [gap for times in token_times.values() for gap in np.diff(times)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a dry run on a small model (CPU)")
    parser.add_argument("--model", help="a checkpoint directory (default: write the Gemma-3-1B-shaped one)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 256 (tiny: 16)")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"default: {MAX_TOKENS} (tiny: 8)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default: inf)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-processes", type=int, default=DEFAULT_CLIENT_PROCESSES,
                        help=f"processes that send the requests and read the streams (default: "
                             f"{DEFAULT_CLIENT_PROCESSES})")  # fmt: skip
    parser.add_argument("--compilation-cache", metavar="DIR", help="passed to the server and to the engine")
    parser.add_argument("--profile-server", action="store_true",
                        help="run the server's process under cProfile; print its 30 costliest functions")  # fmt: skip
    parser.add_argument("--warm-connections", action="store_true",
                        help="each client opens its connections before the clock starts (kept alive, as a "
                             "server's clients usually hold them); default: each request opens one in the load")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="run the server through serve_trace.py; print each load's timeline")  # fmt: skip
    parser.add_argument("--engine-flags", default=None,
                        help="the engine flags of both runs (default: SERVE_FLAGS; tiny: small sizes)")  # fmt: skip
    args = parser.parse_args()
    if args.request_rate <= 0:
        raise SystemExit(f"--request-rate={args.request_rate} must be > 0 (inf: all at once)")
    num_prompts = args.num_prompts or (16 if args.tiny else 256)
    max_tokens = args.max_tokens or (8 if args.tiny else MAX_TOKENS)
    flags = (args.engine_flags.split() if args.engine_flags is not None
             else list(TINY_FLAGS if args.tiny else SERVE_FLAGS))  # fmt: skip
    if args.compilation_cache:
        flags += ["--compilation-cache", args.compilation_cache]
    rows = []

    def record(line: str) -> None:
        print(line, flush=True)
        rows.append(line)

    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model or os.path.join(work, "model")
        if args.model is None:
            write_checkpoint(model_dir, TINY if args.tiny else GEMMA3_1B)
        prompt_file = os.path.join(work, "prompts.txt")
        write_prompts(prompt_file, num_prompts=2 * num_prompts,
                      lengths=TINY_PROMPT_BYTES if args.tiny else PROMPT_BYTES)  # fmt: skip
        every = Path(prompt_file).read_text().splitlines()
        rounds = {"first load after /health (other prompts)": every[num_prompts:], "second load": every[:num_prompts]}
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        profile = os.path.join(work, "server.prof") if args.profile_server else None
        trace = os.path.join(work, "trace") if args.trace else None
        if trace:
            os.makedirs(trace)
        process, startup = start_server(model_dir, flags, port=port, log_path=os.path.join(work, "server.log"),
                                        profile=profile, trace=trace)  # fmt: skip
        measured, starts = {}, {}
        try:
            record(f"jha serve {' '.join(flags)} | healthy after {startup:.1f} s")
            for label, prompts in rounds.items():
                before = scrape(base)
                results, wall, start_at = run_load(base, prompts, model=Path(model_dir).resolve().name,
                                                   max_tokens=max_tokens, rate=args.request_rate,
                                                   max_concurrency=args.max_concurrency, seed=args.seed,
                                                   processes=args.client_processes,
                                                   warm_connections=args.warm_connections)  # fmt: skip
                measured[label] = (results, wall, before, scrape(base))
                starts[label] = start_at
        finally:
            stop_server(process)  # the device is free for the engine alone
        if trace:
            for label, (results, wall, *_) in measured.items():
                print_timeline(label, trace, results, start=starts[label], wall=wall)
        if profile:
            import pstats

            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        no_http = engine_process(model_dir, flags, rounds["second load"], max_tokens=max_tokens)
        direct = engine_generate(model_dir, flags, rounds["second load"], max_tokens=max_tokens)
    record(f"load | {num_prompts} requests at rate {args.request_rate}/s (max concurrency "
           f"{args.max_concurrency or 'none'}) from {args.client_processes} client processes"
           f"{' over connections opened before' if args.warm_connections else ''}, {max_tokens} greedy tokens each, "
           "twice")  # fmt: skip
    for label, (results, wall, before, after) in measured.items():
        report(label, results, wall, before, after, direct, record)
    direct_output = direct["output_tokens"] / direct["seconds"]
    record(f"Engine.generate, the second load's prompts, warm | {direct['seconds']:.2f} s | output "
           f"{direct_output:,.0f} tok/s | total "
           f"{(direct['prompt_tokens'] + direct['output_tokens']) / direct['seconds']:,.0f} tok/s | steps "
           f"{direct['steps']} | latency ms p50/p90/p99 (token callbacks) TTFT {ms(direct['ttft'])}, ITL "
           f"{ms(direct['itl'])}")  # fmt: skip
    record(f"the server's engine process without HTTP, the second load's prompts submitted at once, warm | "
           f"{no_http['seconds']:.2f} s | output {direct['output_tokens'] / no_http['seconds']:,.0f} tok/s "
           f"({direct['seconds'] / no_http['seconds']:.0%} of Engine.generate's)")  # fmt: skip
    print("\n| measurement |\n|---|")
    for line in rows:
        print(f"| {line} |")


if __name__ == "__main__":
    main()
