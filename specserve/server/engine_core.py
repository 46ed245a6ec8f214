"""The engine-core process: owns the engine (scheduler, model runner, drafter) and steps it.

Its loop never waits on HTTP: take every input waiting (add / abort / utility) without blocking,
step the engine, send each front-end one message with its requests' new token ids and the
engine's stats. It blocks only while it has nothing to run. Text is the front-ends' business.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.server import messages as M

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle core wakes this often to see whether its parent is gone


@dataclass(frozen=True)
class CoreAddresses:
    input: str  # front-ends -> core (one socket, all front-ends)
    outputs: tuple[str, ...]  # core -> front-end i

    @classmethod
    def new(cls, num_frontends: int) -> "CoreAddresses":
        d = tempfile.mkdtemp(prefix="specserve-")
        return cls(f"ipc://{d}/input", tuple(f"ipc://{d}/output-{i}" for i in range(num_frontends)))


@dataclass
class EngineInfo:
    """Sent (pickled) to each front-end once the engine is built: what it needs to serve."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    config: Any
    core_pid: int


def stats_dict(stats: Any) -> dict[str, Any]:
    """EngineStats as plain fields (not dataclasses.asdict: it rebuilds a Counter from pairs)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, dict):
            value = dict(value)
        elif isinstance(value, (list, tuple)):
            value = list(value)
        out[f.name] = value
    return out


def is_queue_full(exc: BaseException) -> bool:
    # matched by name: a fake engine in the tests has its own class
    return any(c.__name__ == "QueueFullError" for c in type(exc).__mro__)


class EngineCore:
    def __init__(self, engine: Any, addresses: CoreAddresses, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(addresses.input)
        self.outputs = []
        for addr in addresses.outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow front-end: its queue grows
            sock.setsockopt(zmq.LINGER, 1000)
            sock.bind(addr)
            self.outputs.append(sock)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.owner: dict[str, int] = {}  # request id -> index of the front-end that sent it
        self.stop = False

    # ------------------------------------------------------------ start-up

    def send_ready(self) -> None:
        e = self.engine
        info = pickle.dumps(EngineInfo(e.tokenizer, e.model_name, e.max_model_len, e.config, os.getpid()))
        for sock in self.outputs:
            sock.send(info)  # queued until that front-end connects

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        eng = self.engine
        while not self.stop:
            busy = eng.has_unfinished_requests()
            if not busy:
                if not self.poller.poll(IDLE_POLL_MS):
                    self._check_parent()
                    continue
            replies = self._take_inputs()
            if eng.has_unfinished_requests():
                outs = eng.step()
                self._send(replies, outs)
            elif replies is not None:  # e.g. an abort emptied the engine: gauges must fall now
                self._send(replies, [])
            self._check_parent()

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.error("the server process is gone; engine core exits")
            self.stop = True

    def _take_inputs(self) -> list[M.CoreOutputs] | None:
        """Handle every waiting input; per front-end replies (None: there were no inputs)."""
        replies: list[M.CoreOutputs] | None = None
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return replies
            if replies is None:
                replies = [M.CoreOutputs(deltas=[], accepted=[], rejected=[], utility=[]) for _ in self.outputs]
            msg = M.input_decoder.decode(frame)
            if isinstance(msg, M.AddRequest):
                self._add(msg, replies[msg.client_index])
            elif isinstance(msg, M.Abort):
                for rid in msg.request_ids:
                    if self.owner.pop(rid, None) is not None:
                        self.engine.abort_request(rid)
            elif isinstance(msg, M.Shutdown):
                log.info("engine core stopping")
                self.stop = True
            else:
                replies[msg.client_index].utility.append(self._utility(msg))

    def _add(self, msg: M.AddRequest, reply: M.CoreOutputs) -> None:
        try:
            params = SamplingParams(**msg.params, output_kind=RequestOutputKind.DELTA)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, arrival_time=msg.arrival_time)
        except Exception as e:  # the engine's verdict on this request; it keeps serving the others
            status = 503 if is_queue_full(e) else 400 if isinstance(e, (ValueError, TypeError)) else 500
            reply.rejected.append(M.Rejected(msg.request_id, status, str(e)))
            return
        self.owner[msg.request_id] = msg.client_index
        reply.accepted.append(msg.request_id)

    def _utility(self, msg: M.Utility) -> M.UtilityResult:
        try:
            fn, args = pickle.loads(msg.payload)
            result = getattr(self.engine, fn)(*args) if isinstance(fn, str) else fn(self.engine, *args)
            return M.UtilityResult(msg.call_id, True, pickle.dumps(result))
        except Exception as e:
            return M.UtilityResult(msg.call_id, False, f"{type(e).__name__}: {e}".encode())

    def _send(self, replies: list[M.CoreOutputs] | None, outs: list[Any]) -> None:
        batches = replies or [M.CoreOutputs(deltas=[], accepted=[], rejected=[], utility=[]) for _ in self.outputs]
        for out in outs:
            c = out.outputs[0]
            if c.finish_reason is None:
                d = M.Delta(out.request_id, out.new_token_ids, logprobs=c.logprobs)
                client = self.owner.get(out.request_id)
            else:
                m = out.metrics
                d = M.Delta(out.request_id, out.new_token_ids, c.finish_reason, c.stop_reason, c.logprobs,
                            m.num_cached_tokens, m.spec_verify_steps, m.spec_draft_tokens, m.spec_accepted_tokens)
                client = self.owner.pop(out.request_id, None)
            if client is not None:
                batches[client].deltas.append(d)
        stats = stats_dict(self.engine.get_stats())
        for sock, batch in zip(self.outputs, batches):
            batch.stats = stats
            self._send_to(sock, M.output_encoder.encode(batch))

    @staticmethod
    def _send_to(sock: Any, frame: bytes) -> None:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # that front-end is gone (a PUSH without a peer would block): nobody to tell
            pass

    def fail(self, error: str) -> None:
        for sock in self.outputs:
            self._send_to(sock, M.output_encoder.encode(M.CoreOutputs(error=error)))

    def close(self) -> None:
        self.ctx.destroy(linger=1000)


def shutdown_engine_core(proc: Any, addresses: CoreAddresses, timeout: float = 10.0) -> None:
    """Tell the core to exit (it ignores SIGTERM), wait, kill if it does not; remove its socket files."""
    if proc.is_alive():
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addresses.input)
        sock.send(M.input_encoder.encode(M.Shutdown()))
        proc.join(timeout)
        ctx.destroy(linger=0)
    if proc.is_alive():
        log.warning("the engine core did not stop within %.0f s (a long step?); killing it", timeout)
        proc.kill()
        proc.join(timeout)
    shutil.rmtree(addresses.input[len("ipc://") :].rsplit("/", 1)[0], ignore_errors=True)


def build_engine(config: Any) -> Any:
    """The engine-core process's engine (module level, here: a spawned core unpickles it without
    importing the HTTP side)."""
    from specserve.engine.engine import LLMEngine

    return LLMEngine(config)


def run_engine_core(engine_factory: Callable[[], Any], addresses: CoreAddresses, parent_pid: int,
                    log_level: int = logging.INFO, env: dict[str, str] | None = None) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn); ``env``: set before the engine
    is built (a data-parallel replica's CUDA_VISIBLE_DEVICES)."""
    from specserve.engine.process import own_engine

    # a Ctrl-C or a SIGTERM to the whole process group (systemd, `timeout`): the front-ends drain first,
    # then the supervisor sends Shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    core = engine = None
    try:
        engine = own_engine(engine_factory, len(addresses.outputs), env)  # a core for each front-end
        if getattr(engine, "tp", None) is not None:  # a tensor-parallel rank died: go now, front-ends answer 503
            engine.tp.on_failure = _exit_on_rank_failure
        core = EngineCore(engine, addresses, parent_pid)
        core.send_ready()
        log.info("engine core ready (pid %d)", os.getpid())
        core.run()
    except Exception as e:
        log.error("engine core failed:\n%s", traceback.format_exc())
        if core is not None:
            core.fail(f"{type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        if core is not None:
            core.close()
        if engine is not None and hasattr(engine, "close"):
            engine.close()


def _exit_on_rank_failure(error: str) -> None:
    log.error("engine core exits: %s", error)
    logging.shutdown()
    os._exit(1)
