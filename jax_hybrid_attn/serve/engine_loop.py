"""The engine under the server: one thread owns the `Engine` and steps it (`EngineLoop`).

    asyncio handlers --submit / abort / when_idle--> a thread-safe command queue
        --> the engine thread: applies the commands between steps (`Engine.add_request`, `Engine.abort_request`),
            steps while any request is unfinished, blocks on the queue when none is
        --> each step's tokens and finished requests, as `TokenEvent`s, back to the asyncio loop of each request
            (`loop.call_soon_threadsafe`, one call per loop and step) and into the request's `asyncio.Queue`.

Nothing but the engine thread touches the engine once it runs (`when_idle` runs a function there, between
requests). After requests are aborted the thread reads back the steps still in flight and waits for the device
calls (`Engine.synchronize`), so an idle engine holds no block.

The engine thread also times each request's tokens for the server's metrics (`Observer`) and publishes an
`EngineSnapshot` after each step (requests running and waiting, blocks in use, the engine's counters) that the
metrics read from any thread.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ..engine import Engine, EngineStats, SamplingParams

__all__ = ["EngineLoop", "EngineRequest", "EngineSnapshot", "Observer", "TokenEvent"]

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long `EngineLoop.stop` waits for the engine thread (a step in progress finishes first)."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One request for the engine: its id (unique among the requests the engine holds), prompt and sampling."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """What one step did for one request: its new tokens, and why it finished (``"stop"`` or ``"length"``; None
    while it runs), or why the engine refused it or failed (`error`, `status` the HTTP status it means)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine as of its last step: requests running (admitted) and waiting, KV blocks in use out of
    `usable_blocks` (the pool less the null block), and a copy of its counters."""

    running: int = 0
    waiting: int = 0
    blocks_in_use: int = 0
    usable_blocks: int = 0
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)


class Observer(Protocol):
    """Receives each request's timings (called on the engine thread)."""

    def first_token(self, seconds: float) -> None: ...

    def next_token(self, seconds: float) -> None: ...

    def finished(self, reason: str, *, seconds: float, prompt_tokens: int, output_tokens: int) -> None: ...


@dataclasses.dataclass
class _Tracked:
    """A request the engine thread holds for a handler: where its events go, and its timings."""

    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class _Add:
    requests: tuple[EngineRequest, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _WhenIdle:
    fn: Callable[[Engine], object]
    future: concurrent.futures.Future


_STOP = object()


class EngineLoop:
    """Owns `engine` on a thread of its own once `start`ed; see the module docstring.

    Args:
      engine: the engine (compiled on the thread before it serves, unless it is already).
      observer: receives each request's timings (the server's metrics), or None.
    """

    def __init__(self, engine: Engine, *, observer: Observer | None = None):
        self.engine = engine
        self._observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._idle_waiters: list[_WhenIdle] = []  # engine thread only
        self._deferred: list[_Add] = []  # requests that arrived while idle waiters wait (engine thread only)
        self._needs_drain = False  # steps may be in flight with no request left (after aborts)
        self._thread = threading.Thread(target=self._run, name="jha-engine-loop", daemon=True)
        self.ready = threading.Event()  # compiled and serving
        self.error: BaseException | None = None  # what stopped the engine thread, if it failed
        self.snapshot = EngineSnapshot(usable_blocks=engine.layout.num_blocks - 1, stats=engine.stats)

    # ---------------------------------------------------------------------------------- any thread

    def start(self) -> "EngineLoop":
        """Start the engine thread (it compiles first; `ready` is set once it serves). Idempotent."""
        if not self._thread.is_alive() and not self._thread.ident:
            self._thread.start()
        return self

    def stop(self, *, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine thread after the commands already queued; the requests it holds get no more events."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """Compiled, serving, and not failed."""
        return self.ready.is_set() and self.error is None and self._thread.is_alive()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (`Engine.abort_request`, on the engine thread); ids it no longer holds are ignored."""
        if request_ids:
            self._commands.put(_Abort(tuple(request_ids)))

    def when_idle(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread once it holds no request and no step is in flight (requests
        that arrive meanwhile wait); its result or error in the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_WhenIdle(fn, future))
        return future

    # ---------------------------------------------------------------------------- the event loop

    def submit(self, requests: Sequence[EngineRequest], events: asyncio.Queue) -> None:
        """Queue `requests` for the engine; their `TokenEvent`s go into `events` on the running event loop. The
        caller aborts the ones it stops waiting for (`abort`)."""
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine is not running ({self.error or 'stopped'})")
        self._commands.put(_Add(tuple(requests), asyncio.get_running_loop(), events, time.perf_counter()))

    # --------------------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            if not self.engine.runner.compiled:
                self.engine.compile()
            self._publish()
            self.ready.set()
            while self._serve_once():
                pass
        except BaseException as error:  # the engine failed: every request it holds gets the error
            logger.exception("the engine loop failed")
            self.error = error
            self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
        finally:
            self.ready.clear()

    def _serve_once(self) -> bool:
        """Apply the queued commands, then step once if any request is unfinished; False once told to stop."""
        busy = self.engine.has_unfinished_requests()
        if not busy and self._needs_drain:
            self.engine.step()  # reads back the steps still in flight (their tokens belong to aborted requests)
            self.engine.synchronize()
            self._needs_drain = False
            self._publish()
        if not busy and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                self._run_idle(waiter)
            self._needs_drain = True
            deferred, self._deferred = self._deferred, []
            for command in deferred:
                self._apply(command)
            return True
        commands = [] if busy else [self._commands.get()]  # idle: wait for work
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command is _STOP:
                return False
            self._apply(command)
        if self.engine.has_unfinished_requests():
            self._step()
        return True

    def _apply(self, command) -> None:
        if isinstance(command, _Add) and self._idle_waiters:
            self._deferred.append(command)
        elif isinstance(command, _Add):
            for request in command.requests:
                self._add(request, command)
        elif isinstance(command, _Abort):
            aborted = set(command.request_ids)
            self._deferred = [dataclasses.replace(c, requests=tuple(r for r in c.requests if r.request_id not in aborted))
                              for c in self._deferred]  # fmt: skip
            for request_id in command.request_ids:
                tracked = self._tracked.pop(request_id, None)
                if tracked is not None:
                    self.engine.abort_request(request_id)
                    self._needs_drain = True
                    self._observe_finish(tracked, "abort", time.perf_counter())
        elif isinstance(command, _WhenIdle):
            self._idle_waiters.append(command)

    def _add(self, request: EngineRequest, command: _Add) -> None:
        try:
            self.engine.add_request(request.prompt_token_ids, request.sampling, request_id=request.request_id)
        except (ValueError, NotImplementedError) as error:
            event = TokenEvent(request.request_id, [], error=str(error), status=400)
            self._post(command.loop, [(command.events, event)])
            return
        self._tracked[request.request_id] = _Tracked(request, command.loop, command.events, command.arrival)

    def _step(self) -> None:
        tokens: dict = {}
        finished = self.engine.step(lambda request_id, token: tokens.setdefault(request_id, []).append(token))
        now = time.perf_counter()
        self._needs_drain = True
        done = {output.request_id: output for output in finished}
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id in tokens.keys() | done.keys():
            tracked = self._tracked.get(request_id)
            if tracked is None:  # aborted meanwhile
                continue
            new = tokens.get(request_id, [])
            self._observe_tokens(tracked, len(new), now)
            output = done.get(request_id)
            reason = None if output is None else str(output.finish_reason)
            if output is not None:
                del self._tracked[request_id]
                self._observe_finish(tracked, reason, now)
            by_loop.setdefault(tracked.loop, []).append((tracked.events, TokenEvent(request_id, new, reason)))
        for loop, items in by_loop.items():
            self._post(loop, items)
        self._publish()

    def _run_idle(self, waiter: _WhenIdle) -> None:
        if not waiter.future.set_running_or_notify_cancel():
            return
        try:
            waiter.future.set_result(waiter.fn(self.engine))
        except Exception as error:  # noqa: BLE001 - the caller's function: its error is the caller's
            waiter.future.set_exception(error)

    def _observe_tokens(self, tracked: _Tracked, count: int, now: float) -> None:
        for _ in range(count):
            if self._observer is not None:
                if tracked.last_token is None:
                    self._observer.first_token(now - tracked.arrival)
                else:
                    self._observer.next_token(now - tracked.last_token)
            tracked.last_token = now
        tracked.num_tokens += count

    def _observe_finish(self, tracked: _Tracked, reason: str, now: float) -> None:
        if self._observer is not None:
            self._observer.finished(reason, seconds=now - tracked.arrival,
                                    prompt_tokens=len(tracked.request.prompt_token_ids),
                                    output_tokens=tracked.num_tokens)  # fmt: skip

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
        """Put ``(queue, event)`` items on `loop`'s queues, from the engine thread."""
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody waits for these events
            pass

    def _publish(self) -> None:
        engine, stats = self.engine, self.engine.stats
        usable = engine.layout.num_blocks - 1
        idle = not engine.has_unfinished_requests() and not self._needs_drain
        in_use = usable - engine.manager.num_free_blocks if idle else stats.blocks_in_use
        self.snapshot = EngineSnapshot(
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), blocks_in_use=in_use,
            usable_blocks=usable, stats=dataclasses.replace(stats),
        )  # fmt: skip

    def _fail_all(self, message: str) -> None:
        by_loop: dict = {}
        for request_id, tracked in self._tracked.items():
            event = TokenEvent(request_id, [], error=message, status=500)
            by_loop.setdefault(tracked.loop, []).append((tracked.events, event))
        self._tracked.clear()
        for loop, items in by_loop.items():
            self._post(loop, items)
        pending = [*self._deferred, *self._idle_waiters]  # and the requests queued after the failure
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in pending:
            if isinstance(command, _Add):
                events = [(command.events, TokenEvent(r.request_id, [], error=message, status=500))
                          for r in command.requests]  # fmt: skip
                self._post(command.loop, events)
            elif isinstance(command, _WhenIdle):
                command.future.set_exception(RuntimeError(message))


def _put_all(items: list) -> None:
    for events, event in items:
        events.put_nowait(event)
