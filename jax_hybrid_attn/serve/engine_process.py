"""The engine in a process of its own (`EngineProcess`, an `EngineClient`), as vLLM runs its engine core: the
server's process parses requests, detokenizes and streams; the engine's process schedules and steps. Each has
its own interpreter lock, so a step's host work never waits for the server's per-token work, nor the other way
round.

    server process                                          engine process (spawned)
      submit / abort / when_idle --> commands pipe -->        `build_engine` from the command line's options,
                                                              an `EngineLoop` on it
      the event loop reads the events pipe, and gives   <-- events pipe <-- each step's `TokenEvent`s and
      each request's events to its `Deliver`                             `EngineSnapshot`

The server's event loop reads the events pipe itself (``add_reader``): a reader thread would wait for the
interpreter lock behind the handlers (up to its 5 ms switch interval, several times per step).

Messages are pickled tuples. The engine process sends ``loaded`` (the model config and ``max_model_len``) once
the model is on the device, ``ready`` once every step shape is compiled, then ``events`` and ``snapshot`` per
step, ``idle`` with each `when_idle` result, and ``failed`` with the exception that stopped it; a thread of its
own writes them (`_Outbox`), so that the engine never waits for the pipe, and messages that queued up go as one
``batch``. The server sends ``add``, ``abort``, ``when_idle`` and ``stop``; of the commands of one pass of its
event loop, the first goes at once (an idle engine starts on it) and the others as ``batch``es of up to
`MAX_COMMANDS_PER_MESSAGE`. The server process never initializes the accelerator: only the engine process does.

If the engine process dies, every request waiting on it gets an error event (status 500) and ``/health`` says
so. `stop` asks it to exit and waits; it is killed if it does not.
"""

import argparse
import asyncio
import concurrent.futures
import gc
import itertools
import logging
import multiprocessing
import pickle
import queue
import sys
import threading
from collections.abc import Callable, Sequence

from .engine_loop import Deliver, EngineLoop, EngineRequest, EngineSnapshot, TokenEvent

__all__ = ["EngineProcess", "freeze_startup_heap"]

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long `EngineProcess.stop` waits for the engine process before it kills it."""
EXIT_WAIT_S = 5.0
"""How long the reader waits for the exit code of an engine process whose pipe closed."""
READY_POLL_S = 0.1
MAX_MESSAGES_PER_READ = 64
"""Messages the event loop reads from the engine before it lets other callbacks run."""
MAX_COMMANDS_PER_MESSAGE = 8
"""Commands of one event-loop pass sent as one message at most: a burst's first requests go to the engine as soon
as that many are parsed, not once the pass has parsed the whole burst (the engine steps meanwhile)."""
ENGINE_SWITCH_INTERVAL_S = 5e-4
"""The engine process's interpreter switch interval (Python's default is 5 ms): its command reader waits at most
this long for the lock that the engine thread holds while it schedules, per message."""


class EngineProcess:
    """The engine of ``jha serve``'s options (`args`), in a spawned process; see the module docstring.

    `build` makes ``(engine, tokenizer)`` of `args` in the engine process (`server.build_engine`, the default;
    another must be importable there, as any function a spawned process runs).

    `start` it on the event loop that serves (the app's lifespan does): the engine's messages are read there.
    `when_idle` functions travel pickled: they must be importable (a module's function, or a
    ``functools.partial`` of one).
    """

    def __init__(self, args: argparse.Namespace, *, build: Callable | None = None):
        self._args, self._build = args, build
        self.ready = threading.Event()  # compiled and serving
        self.loaded = threading.Event()  # the model is loaded (or loading failed: `error`)
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self.model_config = None
        self.max_model_len: int | None = None
        self._delivers: dict[str, Deliver] = {}
        self._idle: dict[int, concurrent.futures.Future] = {}
        self._idle_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._process = None
        self._commands = self._events = None
        self._stopping = False
        self._reading_on: asyncio.AbstractEventLoop | None = None
        self._outgoing: list[tuple] = []  # commands from the event loop not yet sent (`_send_soon`)
        self._pass_open = False  # a command went in this event-loop pass; `_end_pass` is scheduled

    # ---------------------------------------------------------------------------------- any thread

    def start(self) -> "EngineProcess":
        """Spawn the engine process (it loads the model, then compiles), unless it runs; called from a running
        event loop, read the engine's messages on that loop from now on."""
        if self._process is None:
            context = multiprocessing.get_context("spawn")
            command_reader, self._commands = context.Pipe(duplex=False)
            self._events, event_writer = context.Pipe(duplex=False)
            self._process = context.Process(target=_engine_main, name="jha-engine", daemon=True,
                                            args=(self._args, self._build, command_reader, event_writer))  # fmt: skip
            self._process.start()
            command_reader.close()
            event_writer.close()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self
        if self._reading_on is None and not self._events.closed:
            loop.add_reader(self._events.fileno(), self._read_available)
            self._reading_on = loop
        return self

    def wait_loaded(self) -> None:
        """Read the engine's messages here until the model is loaded (before any event loop reads them); raises
        what the engine process raised while loading it."""
        while not self.loaded.is_set():
            self._read_one()
        if self.model_config is None:
            raise self.error

    def stop(self, *, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the engine process to exit, and wait for it (killed after `timeout` seconds). Idempotent."""
        if self._process is None or self._commands.closed:
            return
        self._stopping = True
        self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._commands.close()
        if not self._events.closed and self._reading_on is None:  # nobody reads: close it here
            self._closed()

    @property
    def healthy(self) -> bool:
        """Compiled, serving, and not failed."""
        return self.ready.is_set() and self.error is None and self._process is not None and self._process.is_alive()

    def submit(self, requests: Sequence[EngineRequest], deliver: Deliver) -> None:
        """Send `requests` to the engine; their `TokenEvent`s go to `deliver`, called on the event loop that reads
        the engine's messages."""
        if self.error is not None or self._process is None or not self.loaded.is_set():
            state = self.error or ("not started" if self._process is None else "loading the model")
            raise RuntimeError(f"the engine is not running ({state})")
        for request in requests:
            self._delivers[request.request_id] = deliver
        self._send_soon(("add", list(requests)))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the engine; their events stop at once."""
        if request_ids:
            for request_id in request_ids:
                self._delivers.pop(request_id, None)
            self._send_soon(("abort", list(request_ids)))

    def when_idle(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine process once it holds no request (`EngineLoop.when_idle`)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._idle_ids)
        self._idle[call_id] = future
        try:
            self._send(("when_idle", call_id, fn))
        except Exception as error:  # noqa: BLE001 - e.g. a function that cannot be pickled
            self._idle.pop(call_id, None)
            future.set_exception(error)
        return future

    def _send_soon(self, command: tuple) -> None:
        """Send `command`; from the event loop that reads the engine, the first command of a loop pass goes at once
        (the rest of the pass may parse a burst of requests for tens of milliseconds, the first time through the
        handlers more) and the pass's others in messages of up to `MAX_COMMANDS_PER_MESSAGE`, each as soon as it
        is full, the last at the pass's end."""
        if self._reading_on is None or not _running_on(self._reading_on):
            self._send(command)
        elif not self._pass_open:
            self._pass_open = True
            self._reading_on.call_soon(self._end_pass)
            self._send(command)
        else:
            self._outgoing.append(command)
            if len(self._outgoing) == MAX_COMMANDS_PER_MESSAGE:
                self._flush()

    def _end_pass(self) -> None:
        self._pass_open = False
        self._flush()

    def _flush(self) -> None:
        commands, self._outgoing = self._outgoing, []
        if commands:
            self._send(commands[0] if len(commands) == 1 else ("batch", commands))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._commands.send(message)
            except (BrokenPipeError, OSError) as error:
                if self.error is None:
                    self.error = RuntimeError(f"the engine process is gone ({error})")

    # ----------------------------------------------------------------------- the engine's messages

    def _read_available(self) -> None:
        """The event loop's reader: the messages the pipe holds (up to `MAX_MESSAGES_PER_READ`)."""
        for _ in range(MAX_MESSAGES_PER_READ):
            if not self._read_one() or not self._events.poll():
                return

    def _read_one(self) -> bool:
        """Read and apply one message; False once the pipe has closed (the engine process is gone)."""
        try:
            message = self._events.recv()
        except (EOFError, OSError):
            self._closed()
            return False
        for one in message[1] if message[0] == "batch" else (message,):
            self._apply(one)
        return True

    def _apply(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            self._dispatch(message[1])
        elif kind == "snapshot":
            self.snapshot = message[1]
        elif kind == "loaded":
            self.model_config, self.max_model_len, self.snapshot = message[1:]
            self.loaded.set()
        elif kind == "ready":
            self.ready.set()
        elif kind == "idle":
            _, call_id, ok, value = message
            future = self._idle.pop(call_id)
            future.set_result(value) if ok else future.set_exception(value)
        elif kind == "failed":
            self.error = message[1]
            self.loaded.set()

    def _closed(self) -> None:
        if self._reading_on is not None:
            self._reading_on.remove_reader(self._events.fileno())
            self._reading_on = None
        self._events.close()
        self.ready.clear()
        if self.error is None and not self._stopping:
            self._process.join(EXIT_WAIT_S)
            self.error = RuntimeError(f"the engine process exited (exit code {self._process.exitcode})")
        self.loaded.set()
        self._fail_all()

    def _dispatch(self, events: list[TokenEvent]) -> None:
        by_deliver: dict[Deliver, list[TokenEvent]] = {}
        for event in events:
            last = event.finish_reason is not None or event.error is not None
            deliver = self._delivers.pop(event.request_id, None) if last else self._delivers.get(event.request_id)
            if deliver is not None:
                by_deliver.setdefault(deliver, []).append(event)
        for deliver, mine in by_deliver.items():
            deliver(mine)

    def _fail_all(self) -> None:
        message = f"the engine failed: {type(self.error).__name__}: {self.error}"
        self._dispatch([TokenEvent(request_id, [], error=message, status=500) for request_id in list(self._delivers)])
        for future in self._idle.values():
            future.set_exception(RuntimeError(message))
        self._idle.clear()


class _Outbox:
    """The engine process's messages to the server, pickled and written by a thread of their own: the engine
    thread never waits for the pipe (a server that reads behind gets the messages later, in fewer and larger
    writes, and the engine steps on). Messages that queue up go as one ``batch``."""

    def __init__(self, connection):
        self._connection = connection
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="jha-engine-outbox", daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._queue.put(message)

    def close(self, *, timeout: float = STOP_TIMEOUT_S) -> None:
        """Write what is queued, then stop."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def _write(self) -> None:
        while True:
            messages = [self._queue.get()]
            while True:
                try:
                    messages.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = messages[-1] is _CLOSE
            messages = [_picklable(m) for m in messages if m is not _CLOSE]
            try:
                for message in messages if len(messages) == 1 else [("batch", messages)]:
                    self._connection.send(message)
            except (BrokenPipeError, OSError):  # the server is gone
                return
            if closing:
                return


_CLOSE = object()


def _picklable(message: tuple) -> tuple:
    """`message`, or, when what it carries from outside the engine loop (an exception, a `when_idle` result) does
    not pickle, the same message with an error that says so."""
    if message[0] not in ("failed", "idle"):
        return message
    try:
        pickle.dumps(message)
        return message
    except Exception as error:  # noqa: BLE001 - any object can fail to pickle
        if message[0] == "failed":
            return ("failed", RuntimeError(f"{type(message[1]).__name__}: {message[1]}"))
        return ("idle", message[1], False, RuntimeError(f"the result does not pickle: {error}"))


def _engine_main(args: argparse.Namespace, build: Callable | None, commands, events) -> None:
    """The engine process: load, compile, then apply the server's commands until told to stop."""
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    outbox = _Outbox(events)
    try:
        if build is None:
            from .server import build_engine as build

        engine, _tokenizer = build(args, log=sys.stderr)
    except BaseException as error:  # noqa: BLE001 - the server raises it
        outbox.send(("failed", error))
        outbox.close()
        return
    _serve_engine(engine, commands, outbox)


def _serve_engine(engine, commands, outbox: _Outbox) -> None:
    """Run `engine` on an `EngineLoop` for the server at the other end of `commands` and `outbox` (the engine
    process's part once the engine is built), until told to stop or the server is gone."""
    loop = EngineLoop(engine, on_snapshot=lambda snapshot: outbox.send(("snapshot", snapshot)))
    outbox.send(("loaded", engine.model_config, engine.max_model_len, loop.snapshot))
    deliver = lambda batch: outbox.send(("events", batch))

    def watch() -> None:  # the engine thread ends only when told to stop, or when it failed
        while not loop.ready.wait(READY_POLL_S):
            if loop.error is not None:
                break
        else:
            freeze_startup_heap()  # compiled: the heap is as large as it gets before the first request
            outbox.send(("ready",))
        loop.join()
        if loop.error is not None:
            outbox.send(("failed", loop.error))

    def apply(command: tuple) -> bool:
        """Hand one command to the engine loop; False for stop."""
        kind = command[0]
        if kind == "add":
            try:
                loop.submit(command[1], deliver)
            except RuntimeError as error:
                deliver([TokenEvent(r.request_id, [], error=str(error), status=500) for r in command[1]])
        elif kind == "abort":
            loop.abort(command[1])
        elif kind == "when_idle":
            _, call_id, fn = command
            loop.when_idle(fn).add_done_callback(lambda f, call_id=call_id: outbox.send(_idle_result(call_id, f)))
        return kind != "stop"

    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    loop.start()
    threading.Thread(target=watch, name="jha-engine-watch", daemon=True).start()
    running = True
    while running:
        try:
            message = commands.recv()
        except EOFError:  # the server is gone
            break
        for command in message[1] if message[0] == "batch" else (message,):
            running = running and apply(command)
    loop.stop()
    outbox.close()


def freeze_startup_heap() -> None:
    """Put what startup allocated (modules, the model's Python objects, the compiled steps' caches: millions of
    objects in the engine process) out of the garbage collector's reach, as vLLM's processes do once started: a
    burst of requests allocates enough to trigger full collections, and each would walk that whole heap (hundreds
    of milliseconds mid-stream) instead of what the requests made."""
    gc.collect()
    gc.freeze()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _idle_result(call_id: int, future: concurrent.futures.Future) -> tuple:
    error = future.exception()
    return ("idle", call_id, False, error) if error is not None else ("idle", call_id, True, future.result())
