"""Asyncio bridge to the (not thread-safe) engine.

One engine thread owns the engine: between steps it drains an inbox of add/abort commands,
then runs `engine.step()` and hands each output to its request's asyncio queue with
`loop.call_soon_threadsafe`. When there is nothing to do it sleeps on a condition variable.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised or the server is shutting down)."""


def is_queue_full(exc: BaseException) -> bool:
    # Matched by name so this module does not import the engine (and torch) itself.
    return any(c.__name__ == "QueueFullError" for c in type(exc).__mro__)


class EngineObserver(Protocol):
    """Hooks called on the engine thread (e.g. Prometheus metrics); they must not raise."""

    def on_added(self, request_id: str, arrival_time: float) -> None: ...
    def on_aborted(self, request_id: str, now: float) -> None: ...
    def on_step(self, stats: Any, outputs: list[RequestOutput], now: float) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    stream: "RequestStream"
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run fn(engine) on the engine thread (tests and introspection)."""

    fn: Callable[[Any], Any]
    done: asyncio.Future


@dataclass
class RequestStream:
    """Outputs of one request, in order; iterate with `async for`. `close()` aborts if unfinished."""

    request_id: str
    _engine: "AsyncEngine"
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    _closed: bool = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._engine.abort(self.request_id)


class AsyncEngine:
    """Owns the engine thread. Create it inside the running event loop (e.g. app startup)."""

    def __init__(self, engine: Any, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._dead = False  # set once the engine thread has failed everything pending; no more posts
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats: Any = None  # latest engine.get_stats(), refreshed by the engine thread
        self.stats_time: float = 0.0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.stats = copy.deepcopy(self.engine.get_stats())
        self.stats_time = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------ API (event-loop side)

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (raises its ValueError / QueueFullError)."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        assert self._loop is not None
        stream = RequestStream(request_id, self)
        accepted = self._loop.create_future()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompt, params, arrival, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while we waited: do not run it for nobody
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        try:
            self._post(_Abort(request_id))
        except EngineDeadError:
            pass  # nothing left to free

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) between steps on the engine thread and return its result."""
        assert self._loop is not None
        done = self._loop.create_future()
        self._post(_Call(fn, done))
        return await done

    def call_threadsafe(self, fn: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """`call` from a thread other than the event loop's (tests, tools); blocks for the result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.call(fn), self._loop).result(timeout)

    def _post(self, cmd: _Add | _Abort | _Call) -> None:
        with self._cond:
            if self._dead:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            self._inbox.append(cmd)
            self._cond.notify()

    # ------------------------------------------------------------ engine thread

    def _resolve(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def set_it() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(set_it)

    def _push(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(stream._queue.put_nowait, item)

    def _handle(self, cmd: _Add | _Abort | _Call) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            try:
                # Our arrival time is on perf_counter (server metrics); the engine's is wall-clock.
                wall_arrival = time.time() - (time.perf_counter() - cmd.arrival_time)
                eng.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=wall_arrival)
            except Exception as e:  # bad input / queue full: the caller turns it into a 4xx
                self._resolve(cmd.accepted, exc=e)
                return
            self._streams[cmd.request_id] = cmd.stream
            self._resolve(cmd.accepted, True)
            self._observe("on_added", cmd.request_id, cmd.arrival_time)
        elif isinstance(cmd, _Abort):
            if self._streams.pop(cmd.request_id, None) is not None:
                eng.abort_request(cmd.request_id)
                self._observe("on_aborted", cmd.request_id, time.perf_counter())
        else:
            try:
                self._resolve(cmd.done, cmd.fn(eng))
            except Exception as e:
                self._resolve(cmd.done, exc=e)

    def _observe(self, hook: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:  # metrics must never take serving down
            log.exception("observer hook %s failed", hook)

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stop and not eng.has_unfinished_requests():
                        self._cond.wait()
                    if self._stop:
                        break
                    cmds, self._inbox = self._inbox, []
                for cmd in cmds:
                    self._handle(cmd)
                if not eng.has_unfinished_requests():
                    continue
                outputs = eng.step()
                now = time.perf_counter()
                # a copy: the engine may hand out its live stats object, which it keeps mutating
                self.stats = copy.deepcopy(eng.get_stats())
                self.stats_time = now
                self._observe("on_step", self.stats, outputs, now)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:  # aborted meanwhile
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    self._push(stream, out)
        except BaseException as e:
            log.error("engine thread died:\n%s", traceback.format_exc())
            self.error = e
        finally:
            self._fail_all(self.error or EngineDeadError("engine shut down"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._dead = True
            cmds, self._inbox = self._inbox, []
        err = EngineDeadError(f"engine stopped: {exc!r}")
        for cmd in cmds:
            if isinstance(cmd, _Add):
                self._resolve(cmd.accepted, exc=err)
            elif isinstance(cmd, _Call):
                self._resolve(cmd.done, exc=err)
        for stream in self._streams.values():
            self._push(stream, err)
        self._streams.clear()
