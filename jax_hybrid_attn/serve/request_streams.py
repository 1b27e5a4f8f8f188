"""The asyncio side of an `EngineClient` (`RequestStreams`): each request's `TokenEvent`s into an asyncio queue
on the event loop that submitted it, and each request's timings to an `Observer` (the server's metrics).

The engine client calls `RequestStreams` once per step with that step's events: on the event loop itself (the
engine process's pipe is read there), or from the engine's thread (an `EngineLoop` in this process), whence the
events reach the event loop in one ``call_soon_threadsafe`` per loop and step. Times are taken on arrival from
the engine: time to first token from the request's submission, inter-token latency between its steps.
"""

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

from .engine_loop import EngineClient, EngineRequest, TokenEvent

__all__ = ["Observer", "RequestStreams"]


class Observer(Protocol):
    """Receives each request's timings (called on the engine client's thread)."""

    def first_token(self, seconds: float) -> None: ...

    def next_token(self, seconds: float) -> None: ...

    def finished(self, reason: str, *, seconds: float, prompt_tokens: int, output_tokens: int) -> None: ...


@dataclasses.dataclass
class _Stream:
    """A submitted request: where its events go, and its timings."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    prompt_tokens: int
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0


class RequestStreams:
    """Submits requests to `engine` and routes their events back to the asyncio handlers.

    Args:
      engine: the engine client.
      observer: receives each request's timings, or None.
    """

    def __init__(self, engine: EngineClient, *, observer: Observer | None = None):
        self.engine = engine
        self._observer = observer
        self._streams: dict[str, _Stream] = {}

    def open(self, requests: Sequence[EngineRequest]) -> asyncio.Queue:
        """Submit `requests` (from a running event loop); their events arrive in the returned queue. Raises
        RuntimeError when the engine is not running. A request's stream ends with its last event (a finish reason
        or an error); `close` the requests the caller stops waiting for."""
        loop, events, now = asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter()
        for request in requests:
            self._streams[request.request_id] = _Stream(loop, events, len(request.prompt_token_ids), now)
        try:
            self.engine.submit(requests, self._deliver)
        except RuntimeError:
            for request in requests:
                self._streams.pop(request.request_id, None)
            raise
        return events

    def close(self, request_ids: Sequence[str]) -> None:
        """Stop routing the requests' events, and abort in the engine those that have not finished."""
        now, running = time.perf_counter(), []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                running.append(request_id)
                self._observe_finish(stream, "abort", now)
        self.engine.abort(running)

    def _deliver(self, events: list[TokenEvent]) -> None:
        """One step's events (the engine client's thread)."""
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for event in events:
            last = event.finish_reason is not None or event.error is not None
            stream = self._streams.pop(event.request_id, None) if last else self._streams.get(event.request_id)
            if stream is None:  # closed meanwhile
                continue
            self._observe_tokens(stream, len(event.token_ids), now)
            if event.finish_reason is not None:
                self._observe_finish(stream, event.finish_reason, now)
            by_loop.setdefault(stream.loop, []).append((stream.events, event))
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, items in by_loop.items():
            if loop is current:
                _put_all(items)
                continue
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody waits for these events
                pass

    def _observe_tokens(self, stream: _Stream, count: int, now: float) -> None:
        if self._observer is not None and count:
            if stream.last_token is None:
                self._observer.first_token(now - stream.arrival)
            else:
                self._observer.next_token(now - stream.last_token)
            for _ in range(count - 1):  # several tokens in one step: no time between them
                self._observer.next_token(0.0)
        if count:
            stream.last_token = now
        stream.num_tokens += count

    def _observe_finish(self, stream: _Stream, reason: str, now: float) -> None:
        if self._observer is not None:
            self._observer.finished(reason, seconds=now - stream.arrival, prompt_tokens=stream.prompt_tokens,
                                    output_tokens=stream.num_tokens)  # fmt: skip


def _put_all(items: list) -> None:
    for events, event in items:
        events.put_nowait(event)
