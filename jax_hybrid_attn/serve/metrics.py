"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own (never the process-wide one).

From the engine (its `EngineSnapshot`, read at each scrape): requests running and waiting, KV blocks in use and
the pool's usage, the prefix cache's hit rate and its token counts, preemptions, steps. Per request (observed as
the engine's events reach the server, `request_streams.Observer`): time to first token (from the request's
submission), inter-token latency, end-to-end latency, and requests finished by reason. Names follow vLLM's,
prefixed ``jha:``.
"""

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine_loop import EngineSnapshot

__all__ = ["CONTENT_TYPE", "PREFIX", "ServerMetrics"]

PREFIX = "jha:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    """The metrics of one server. It is the request streams' `Observer`; `snapshot` returns the engine's latest
    `EngineSnapshot` (read at each scrape)."""

    def __init__(self, *, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Seconds between consecutive tokens of a request.",
            buckets=ITL_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
            buckets=E2E_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.requests_finished = Counter(
            f"{PREFIX}request_finished", "Requests that ended, by finish reason (stop, length, abort).",
            ["finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Output tokens of ended requests.",
                                         registry=self.registry)  # fmt: skip
        self.registry.register(_EngineCollector(snapshot))

    # request_streams.Observer
    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(self, reason: str, *, seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        self.requests_finished.labels(finished_reason=reason).inc()
        self.generation_tokens.inc(output_tokens)
        if reason != "abort":
            self.e2e_request_latency.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's gauges and counters, from its latest snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        stats = s.stats
        usage = s.blocks_in_use / s.usable_blocks if s.usable_blocks else 0.0
        hit_rate = stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        gauges = {
            "num_requests_running": ("Requests admitted by the engine (holding a request slot).", s.running),
            "num_requests_waiting": ("Requests queued for a request slot.", s.waiting),
            "kv_cache_blocks_in_use": ("KV-cache blocks in use.", s.blocks_in_use),
            "kv_cache_blocks_total": ("KV-cache blocks in the pool (the null block left out).", s.usable_blocks),
            "kv_cache_usage_perc": ("KV-cache usage: blocks in use over the pool, 0 to 1.", usage),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache over prompt tokens.", hit_rate),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}{name}", documentation, value=value)
        counters = {
            "num_preemptions": ("Requests preempted (their blocks freed, recomputed later).", stats.preemptions),
            "prompt_tokens": ("Prompt tokens of requests whose prefill began.", stats.prompt_tokens),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.", stats.cached_prompt_tokens),
            "engine_steps": ("Engine steps read back.", stats.steps),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}{name}", documentation, value=value)
