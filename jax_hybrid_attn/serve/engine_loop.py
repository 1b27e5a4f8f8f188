"""The engine on a thread of its own (`EngineLoop`), and what the server's handlers expect of an engine
(`EngineClient`: this loop, or `engine_process.EngineProcess` running it in another process).

    submit / abort / when_idle, from any thread --> a thread-safe command queue
        --> the engine thread: applies the commands between steps (`Engine.add_request`, `Engine.abort_request`),
            steps while any request is unfinished, blocks on the queue when none is
        --> each step's new tokens and finished requests, as `TokenEvent`s, to the `Deliver` callable each
            request was submitted with (one call per callable and step, on the engine thread).

Nothing but the engine thread touches the engine once it runs (`when_idle` runs a function there, between
requests). After requests are aborted the thread reads back the steps still in flight and waits for the device
calls (`Engine.synchronize`), so an idle engine holds no block. After each step it publishes an `EngineSnapshot`
(requests running and waiting, blocks in use, the engine's counters), read from any thread.
"""

import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from ..engine import Engine, EngineStats, SamplingParams
from ..models import ModelConfig

__all__ = ["Deliver", "EngineClient", "EngineLoop", "EngineRequest", "EngineSnapshot", "TokenEvent"]

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long `EngineLoop.stop` waits for the engine thread (a step in progress finishes first)."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One request for the engine: its id (unique among the requests the engine holds), prompt and sampling."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class TokenEvent(NamedTuple):
    """What one step did for one request: its new tokens, and why it finished (``"stop"`` or ``"length"``; None
    while it runs), or why the engine refused it or failed (`error`, `status` the HTTP status it means)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None


Deliver = Callable[[list[TokenEvent]], None]
"""Takes one step's events of the requests submitted with it (called once per step, from the engine's thread)."""


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine as of its last step: requests running (admitted) and waiting, KV blocks in use out of
    `usable_blocks` (the pool less the null block), and a copy of its counters."""

    running: int = 0
    waiting: int = 0
    blocks_in_use: int = 0
    usable_blocks: int = 0
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)


class EngineClient(Protocol):
    """What the server's handlers use of an engine. `model_config` and `max_model_len` are None until the model
    has loaded; `ready` is set once every step shape is compiled; `error` is what stopped the engine, if it
    failed."""

    ready: threading.Event
    error: BaseException | None
    snapshot: EngineSnapshot
    model_config: ModelConfig | None
    max_model_len: int | None

    @property
    def healthy(self) -> bool: ...

    def start(self) -> "EngineClient": ...

    def stop(self, *, timeout: float = STOP_TIMEOUT_S) -> None: ...

    def submit(self, requests: Sequence[EngineRequest], deliver: Deliver) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def when_idle(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future: ...


@dataclasses.dataclass(frozen=True)
class _Add:
    requests: tuple[EngineRequest, ...]
    deliver: Deliver


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _WhenIdle:
    fn: Callable[[Engine], object]
    future: concurrent.futures.Future


_STOP = object()


class EngineLoop:
    """Owns `engine` on a thread of its own once `start`ed; see the module docstring. An `EngineClient`.

    Args:
      engine: the engine (compiled on the thread before it serves, unless it is already).
      on_snapshot: called on the engine thread with each new `EngineSnapshot` (after the step's events).
    """

    def __init__(self, engine: Engine, *, on_snapshot: Callable[[EngineSnapshot], None] | None = None):
        self.engine = engine
        self.model_config, self.max_model_len = engine.model_config, engine.max_model_len
        self._on_snapshot = on_snapshot
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._delivers: dict[str, Deliver] = {}  # the requests the engine holds (engine thread only)
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

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (it was stopped, or it failed)."""
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """Compiled, serving, and not failed."""
        return self.ready.is_set() and self.error is None and self._thread.is_alive()

    def submit(self, requests: Sequence[EngineRequest], deliver: Deliver) -> None:
        """Queue `requests` for the engine; their `TokenEvent`s go to `deliver`. The caller aborts the ones it
        stops waiting for (`abort`)."""
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine is not running ({self.error or 'stopped'})")
        self._commands.put(_Add(tuple(requests), deliver))

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

    # --------------------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            if not self.engine.runner.compiled:
                self._compile()
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

    def _compile(self) -> None:
        """Compile the engine, logging each step function as it is ready (a server says nothing otherwise for as
        long as that takes)."""
        total = len(self.engine.runner.executable_keys())
        shapes = ", ".join(map(str, self.engine.runner.shapes))
        logger.info("compiling %d step functions (step shapes %s); /health answers 503 until then", total, shapes)
        done = itertools.count(1)
        report = self.engine.compile(progress=lambda name: logger.info("compiled %d/%d: %s", next(done), total, name))
        logger.info("compiled in %.1f s; serving", report.wall_s + report.warm_up_s)

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
                self._add(request, command.deliver)
        elif isinstance(command, _Abort):
            aborted = set(command.request_ids)
            self._deferred = [dataclasses.replace(c, requests=tuple(r for r in c.requests if r.request_id not in aborted))
                              for c in self._deferred]  # fmt: skip
            for request_id in command.request_ids:
                if self._delivers.pop(request_id, None) is not None:
                    self.engine.abort_request(request_id)
                    self._needs_drain = True
        elif isinstance(command, _WhenIdle):
            self._idle_waiters.append(command)

    def _add(self, request: EngineRequest, deliver: Deliver) -> None:
        try:
            self.engine.add_request(request.prompt_token_ids, request.sampling, request_id=request.request_id)
        except (ValueError, NotImplementedError) as error:
            deliver([TokenEvent(request.request_id, [], error=str(error), status=400)])
            return
        self._delivers[request.request_id] = deliver

    def _step(self) -> None:
        tokens: dict = {}
        finished = self.engine.step(lambda request_id, token: tokens.setdefault(request_id, []).append(token))
        self._needs_drain = True
        reasons = {output.request_id: str(output.finish_reason) for output in finished}
        by_deliver: dict[Deliver, list[TokenEvent]] = {}
        for request_id in tokens.keys() | reasons.keys():
            reason = reasons.get(request_id)
            deliver = self._delivers.get(request_id) if reason is None else self._delivers.pop(request_id, None)
            if deliver is not None:  # else aborted meanwhile
                by_deliver.setdefault(deliver, []).append(TokenEvent(request_id, tokens.get(request_id, []), reason))
        for deliver, events in by_deliver.items():
            deliver(events)
        self._publish()

    def _run_idle(self, waiter: _WhenIdle) -> None:
        if not waiter.future.set_running_or_notify_cancel():
            return
        try:
            waiter.future.set_result(waiter.fn(self.engine))
        except Exception as error:  # noqa: BLE001 - the caller's function: its error is the caller's
            waiter.future.set_exception(error)

    def _publish(self) -> None:
        engine, stats = self.engine, self.engine.stats
        usable = engine.layout.num_blocks - 1
        idle = not engine.has_unfinished_requests() and not self._needs_drain
        in_use = usable - engine.manager.num_free_blocks if idle else stats.blocks_in_use
        self.snapshot = EngineSnapshot(
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), blocks_in_use=in_use,
            usable_blocks=usable, stats=dataclasses.replace(stats),
        )  # fmt: skip
        if self._on_snapshot is not None:
            self._on_snapshot(self.snapshot)

    def _fail_all(self, message: str) -> None:
        by_deliver: dict[Deliver, list[TokenEvent]] = {}
        for request_id, deliver in self._delivers.items():
            by_deliver.setdefault(deliver, []).append(TokenEvent(request_id, [], error=message, status=500))
        self._delivers.clear()
        pending = [*self._deferred, *self._idle_waiters]  # and the requests queued after the failure
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in pending:
            if isinstance(command, _Add):
                events = [TokenEvent(r.request_id, [], error=message, status=500) for r in command.requests]
                by_deliver.setdefault(command.deliver, []).extend(events)
            elif isinstance(command, _WhenIdle):
                command.future.set_exception(RuntimeError(message))
        for deliver, events in by_deliver.items():
            _deliver_safely(deliver, events)


def _deliver_safely(deliver: Deliver, events: list[TokenEvent]) -> None:
    try:
        deliver(events)
    except Exception:
        logger.exception("delivering the engine's failure failed")
