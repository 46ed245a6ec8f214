"""The front-end's side of the engine core: send requests, receive per-step token ids, make text.

One receive task takes the core's messages (one per step), detokenizes each request's new tokens
and wakes whoever waits on that request. A stream takes everything its request gained since its
last chunk, so a slow client never holds anything up but its own chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import time
from types import SimpleNamespace
from typing import Any, Callable

import zmq
import zmq.asyncio

from specserve.engine.stop import find_stop_string, streamable_text_end
from specserve.sampling_params import SamplingParams
from specserve.server import messages as M
from specserve.server.engine_core import CoreAddresses, EngineInfo

log = logging.getLogger(__name__)

_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "max_spec_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "structured_outputs")


class EngineDeadError(RuntimeError):
    """The engine core is gone (it failed or was killed)."""


class RequestRejected(Exception):
    """The engine refused a request (bad input, queue full); ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RequestState:
    """One request's output as the front-end builds it: ids from the core, text made here.

    ``text[:text_end]`` may be handed out; the tail after it could still begin a stop string.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, detok: Any,
                 stream_interval: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detok = detok
        self.stream_interval = stream_interval
        self.text = ""
        self.text_end = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.final: M.Delta | None = None  # the finishing delta (cache and speculation counts)
        self.error: BaseException | None = None
        self.taken_tokens = 0  # tokens (and text up to taken_chars) already handed to the client
        self.taken_chars = 0
        self.ready = asyncio.Event()  # set when a chunk is due (stream_interval tokens, or the end)
        self.done = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add(self, d: M.Delta) -> None:
        ids = d.new_token_ids
        if ids:
            if len(ids) > 1:
                self.text += self.detok.append(ids[:-1])
            last_start = len(self.text)  # a stop string ends in the last token's text
            self.text += self.detok.append(ids[-1])
            self.token_ids.extend(ids)
            if self.logprobs is not None and d.logprobs is not None:
                self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            if d.finish_reason == "stop" and isinstance(d.stop_reason, str) and ids:
                found = find_stop_string(self.text, self.params.stop_list, last_start)
                if found is not None:
                    at, s = found
                    self.text = self.text[: at + len(s)] if self.params.include_stop_str_in_output else self.text[:at]
            self.finish_reason, self.stop_reason, self.final = d.finish_reason, d.stop_reason, d
        self.text_end = max(self.text_end, streamable_text_end(self.text, self.params, self.finished))
        if self.finished:
            self.ready.set()
            self.done.set()
        elif len(self.token_ids) - self.taken_tokens >= self.stream_interval:
            self.ready.set()

    def finish_here(self, reason: str) -> None:
        """End it on this side (shutdown): the core was told to abort it."""
        if not self.finished:
            self.add(M.Delta(self.request_id, [], reason))

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.error = error
            self.ready.set()
            self.done.set()

    def take(self) -> tuple[str, list[int], list[dict[int, float]] | None]:
        """(text, token ids, logprobs) gained since the last take."""
        self.ready.clear()
        t0, c0 = self.taken_tokens, self.taken_chars
        self.taken_tokens, self.taken_chars = len(self.token_ids), self.text_end
        lps = self.logprobs[t0:] if self.logprobs is not None else None
        return self.text[c0 : self.text_end], self.token_ids[t0:], lps

    async def next_chunk(self) -> tuple[str, list[int], list[dict[int, float]] | None, bool]:
        """Wait for the next chunk: (text, ids, logprobs, last). Raises EngineDeadError if the core died."""
        await self.ready.wait()
        if self.error is not None:
            raise self.error
        text, ids, lps = self.take()
        return text, ids, lps, self.finished and self.taken_tokens == len(self.token_ids)

    async def result(self) -> None:
        await self.done.wait()
        if self.error is not None:
            raise self.error


class EngineClient:
    """Front-end ``client_index``'s connection to the engine core. Create and start it in the event loop."""

    def __init__(self, addresses: CoreAddresses, client_index: int, core_pid: int, metrics: Any = None,
                 stream_interval: int = 1) -> None:
        self.addresses = addresses
        self.client_index = client_index
        self.core_pid = core_pid
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.info: EngineInfo | None = None
        self.requests: dict[str, RequestState] = {}
        self.stats: SimpleNamespace | None = None  # the core's latest EngineStats fields
        self.error: BaseException | None = None
        self.on_dead: Callable[[], None] | None = None
        self._accepting: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._actx = zmq.asyncio.Context()
        self._sctx = zmq.Context()
        self._out: Any = None
        self._in: Any = None
        self._task: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = 600.0) -> EngineInfo:
        """Connect and wait for the engine to be built; raises EngineDeadError if the core dies first."""
        self._loop = asyncio.get_running_loop()
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.connect(self.addresses.outputs[self.client_index])
        self._in = self._sctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.connect(self.addresses.input)
        self._pidfd = os.pidfd_open(self.core_pid)
        dead = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._on_core_exit, dead)
        ready = asyncio.ensure_future(self._out.recv())
        done, _ = await asyncio.wait({ready, dead}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            raise EngineDeadError(self.error or f"the engine core did not start within {timeout:.0f} s")
        self.info = pickle.loads(ready.result())
        self._task = asyncio.ensure_future(self._receive())
        return self.info

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._pidfd is not None and self._loop is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._actx.destroy(linger=0)
        self._sctx.destroy(linger=0)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.info is not None

    def _on_core_exit(self, dead: asyncio.Future | None = None) -> None:
        self._loop.remove_reader(self._pidfd)
        if not dead.done():
            dead.set_result(None)
        self._die(EngineDeadError(f"the engine core (pid {self.core_pid}) exited"))

    def _die(self, error: EngineDeadError) -> None:
        if self.error is not None:
            return
        self.error = error
        log.error("%s", error)
        for fut in [*self._accepting.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        self._accepting.clear()
        self._calls.clear()
        for state in self.requests.values():
            state.fail(error)
        self.requests.clear()
        if self.on_dead is not None:
            self.on_dead()

    # ------------------------------------------------------------ requests

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival: float) -> RequestState:
        """Send a request; returns once the core took it. ``arrival``: perf_counter at the HTTP handler."""
        if self.error is not None:
            raise self.error
        assert self.info is not None
        fields = {name: getattr(params, name) for name in _PARAM_FIELDS}
        wall_arrival = time.time() - (time.perf_counter() - arrival)
        detok = self.info.tokenizer.detokenizer(prompt_token_ids)
        state = RequestState(request_id, prompt_token_ids, params, detok, self.stream_interval)
        accepted = self._loop.create_future()
        self._accepting[request_id] = accepted
        self.requests[request_id] = state
        if self.metrics is not None:  # before the send: its first tokens may come with the acceptance
            self.metrics.on_added(request_id, arrival)
        self._send(M.AddRequest(request_id, self.client_index, prompt_token_ids, fields, wall_arrival))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while we waited: do not run it for nobody
            self.abort(request_id)
            raise
        except BaseException:
            self.requests.pop(request_id, None)
            if self.metrics is not None:
                self.metrics.on_rejected(request_id)
            raise
        return state

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); the core frees its KV blocks."""
        state = self.requests.pop(request_id, None)
        if state is None or self.error is not None:
            return
        self._send(M.Abort([request_id]))
        if self.metrics is not None:
            self.metrics.on_aborted(request_id)

    def abort_all(self) -> int:
        """Finish every request in flight with finish_reason "abort" (shutdown); returns how many."""
        states = list(self.requests.values())
        if not states:
            return 0
        self.requests.clear()
        if self.error is None:
            self._send(M.Abort([s.request_id for s in states]))
        for state in states:
            state.finish_here("abort")
            if self.metrics is not None:
                self.metrics.on_aborted(state.request_id)
        return len(states)

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    async def call(self, fn: str | Callable[..., Any], *args: Any) -> Any:
        """Run an engine method (by name) or fn(engine, *args) in the core between steps; its result."""
        if self.error is not None:
            raise self.error
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._send(M.Utility(call_id, self.client_index, pickle.dumps((fn, args))))
        return await fut

    def call_threadsafe(self, fn: str | Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """``call`` from a thread other than the event loop's (tests, tools); blocks for the result."""
        return asyncio.run_coroutine_threadsafe(self.call(fn, *args), self._loop).result(timeout)

    def _send(self, msg: Any) -> None:
        self._in.send(M.input_encoder.encode(msg), copy=False)

    # ------------------------------------------------------------ the receive task

    async def _receive(self) -> None:
        sock, decode = self._out, M.output_decoder.decode
        try:
            while True:
                frames = [await sock.recv(copy=False)]
                while True:  # whatever else has arrived meanwhile
                    try:
                        frames.append(sock.recv(zmq.NOBLOCK, copy=False).result())
                    except zmq.Again:
                        break
                stats = None
                for frame in frames:
                    stats = self._handle(decode(frame.buffer)) or stats
                if stats is not None:  # counters are cumulative: the newest message's stats suffice
                    self.stats = SimpleNamespace(**stats)
                    if self.metrics is not None:
                        self.metrics.on_stats(self.stats, time.perf_counter())
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a bug here must not leave requests hanging
            log.exception("engine client receive loop failed")
            self._die(EngineDeadError(f"front-end receive loop failed: {e!r}"))

    def _handle(self, batch: M.CoreOutputs) -> dict[str, Any] | None:
        """Deliver one message; its engine stats (the caller applies only the newest)."""
        now = time.perf_counter()
        for rid in batch.accepted:
            fut = self._accepting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for r in batch.rejected:
            fut = self._accepting.pop(r.request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(RequestRejected(r.status, r.message))
        for u in batch.utility:
            fut = self._calls.pop(u.call_id, None)
            if fut is not None and not fut.done():
                if u.ok:
                    fut.set_result(pickle.loads(u.payload))
                else:
                    fut.set_exception(RuntimeError(u.payload.decode()))
        metrics = self.metrics
        for d in batch.deltas:
            state = self.requests.get(d.request_id)
            if state is None:  # aborted here meanwhile
                continue
            state.add(d)
            if state.finished:
                del self.requests[d.request_id]
            if metrics is not None:
                metrics.on_output(state, len(d.new_token_ids), now)
        if batch.error is not None:
            self._die(EngineDeadError(f"the engine core failed: {batch.error}"))
        return batch.stats


class DataParallelClient:
    """A front-end's connection to ``--data-parallel-size`` engine-core replicas, with EngineClient's
    interface. A request goes to the replica with the fewest of this front-end's requests outstanding
    (ties: the fewest running + waiting in its last stats); stats are the replicas' summed (KV usage:
    their mean). One replica gone fails them all: the front-end answers 503 and exits, as with one."""

    def __init__(self, addresses: list[CoreAddresses], client_index: int, core_pids: list[int],
                 stream_interval: int = 1) -> None:
        self.replicas = [EngineClient(a, client_index, pid, stream_interval=stream_interval)
                         for a, pid in zip(addresses, core_pids)]
        self.client_index = client_index
        self.on_dead: Callable[[], None] | None = None
        self._metrics: Any = None
        self._dead = False

    @property
    def metrics(self) -> Any:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Any) -> None:
        self._metrics = metrics
        for r in self.replicas:
            r.metrics = None if metrics is None else _ReplicaMetrics(self, metrics)

    @property
    def info(self) -> EngineInfo | None:
        return self.replicas[0].info

    @property
    def stats(self) -> SimpleNamespace | None:
        return merge_stats([r.stats for r in self.replicas if r.stats is not None])

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    async def start(self, timeout: float = 600.0) -> EngineInfo:
        infos = await asyncio.gather(*(r.start(timeout) for r in self.replicas))
        for r in self.replicas:
            r.on_dead = self._replica_dead
        return infos[0]

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def _replica_dead(self) -> None:
        if self._dead:
            return
        self._dead = True
        error = self.error
        for r in self.replicas:
            r._die(EngineDeadError(f"a data-parallel replica failed: {error}"))
        if self.on_dead is not None:
            self.on_dead()

    def pick(self) -> EngineClient:
        """The least loaded replica."""
        def load(i: int) -> tuple[int, int, int]:
            r = self.replicas[i]
            queued = (r.stats.num_running + r.stats.num_waiting) if r.stats is not None else 0
            return r.num_in_flight, queued, i

        return self.replicas[min(range(len(self.replicas)), key=load)]

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival: float) -> RequestState:
        return await self.pick().add_request(request_id, prompt_token_ids, params, arrival)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if request_id in r.requests:
                r.abort(request_id)

    def abort_all(self) -> int:
        return sum(r.abort_all() for r in self.replicas)

    async def call(self, fn: str | Callable[..., Any], *args: Any) -> Any:
        """``fn`` run in replica 0 (``replicas[i].call``: in replica i)."""
        return await self.replicas[0].call(fn, *args)

    def call_threadsafe(self, fn: str | Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        return self.replicas[0].call_threadsafe(fn, *args, timeout=timeout)


class _ReplicaMetrics:
    """A replica's metrics hooks: the front-end's, but for stats, which go in summed over the replicas."""

    def __init__(self, dp: DataParallelClient, metrics: Any) -> None:
        self.dp, self.inner = dp, metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on_stats(self, stats: Any, now: float) -> None:
        self.inner.on_stats(self.dp.stats, now)


def merge_stats(stats: list[SimpleNamespace]) -> SimpleNamespace | None:
    """Several engines' stats as one: counts summed (lists by position, dicts by key), KV usage averaged."""
    if not stats:
        return None
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in vars(s).items():
            if k not in out:
                out[k] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
            elif isinstance(v, list):
                cur = out[k] + [0] * (len(v) - len(out[k]))
                out[k] = [a + b for a, b in zip(cur, v + [0] * (len(cur) - len(v)))]
            elif isinstance(v, dict):
                for kk, vv in v.items():
                    out[k][kk] = out[k].get(kk, 0) + vv
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and out[k] is not None:
                out[k] += v
    if "kv_usage" in out:
        out["kv_usage"] /= len(stats)
    return SimpleNamespace(**out)


def connect(addresses: list[CoreAddresses], client_index: int, core_pids: list[int],
            stream_interval: int = 1) -> EngineClient | DataParallelClient:
    """Front-end ``client_index``'s client of one engine core, or of several data-parallel replicas."""
    if len(addresses) == 1:
        return EngineClient(addresses[0], client_index, core_pids[0], stream_interval=stream_interval)
    return DataParallelClient(addresses, client_index, core_pids, stream_interval)
