"""Rank 0 of a tensor-parallel group: the engine (scheduler, drafter, sampling) runs here once, and
every call on the target model goes to the other ranks first (``plans.py``), which run their
shards alongside (``worker.py``).

Ranks past 0 are started here (one process each, ``python -m specserve.distributed.worker``) or,
under torchrun, by torchrun itself. A rank that exits or fails makes the next target call raise
``RankFailure`` naming it (a watchdog also notices an idle engine's dead rank within a second and
calls ``on_failure``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from specserve.attention.base import AttentionBackend, AttentionMetadata, get_forward_context
from specserve.config import EngineConfig
from specserve.distributed.parallel import TPGroup, init_group, rank_device, torchrun_env
from specserve.distributed.plans import send_op

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> "TPDriver":
    """Rank 0's group: joined under torchrun (its environment), else with ranks 1..N-1 started here."""
    size = config.tensor_parallel_size
    env = torchrun_env()
    if env is not None:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size={size}")
        if rank != 0:
            raise RuntimeError(f"rank {rank} runs specserve.distributed.worker, not an engine")
        return TPDriver(init_group(0, size, "env://", rank_device(device, int(env["LOCAL_RANK"]))), {})
    port = _free_port()
    procs = {}
    for r in range(1, size):
        wenv = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(size),
                    LOCAL_RANK=str(r))
        p = subprocess.Popen([sys.executable, "-m", "specserve.distributed.worker"], stdin=subprocess.PIPE, env=wenv)
        assert p.stdin is not None
        p.stdin.write(pickle.dumps((config, os.getpid())))  # (the worker exits when this process is gone)
        p.stdin.close()
        procs[r] = p
    try:
        tp = init_group(0, size, f"tcp://127.0.0.1:{port}", rank_device(device, 0))
    except Exception:
        for p in procs.values():
            p.kill()
        raise
    return TPDriver(tp, procs)


class TPDriver:
    def __init__(self, tp: TPGroup, procs: dict[int, subprocess.Popen]) -> None:
        self.tp = tp
        self.procs = procs  # rank -> process, for ranks started here
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None  # the engine core: exit at once
        self.closed = False
        self._finalizer = weakref.finalize(self, _stop, procs)
        if procs:
            threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    # -- the ops -----------------------------------------------------------------------------
    def send(self, op: str, header: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()) -> None:
        with self.guard():
            send_op(self.tp, op, header, tensors)

    def init_workers(self, layout: Any) -> None:
        """``layout``: the runner's KVLayout, which every rank's cache follows."""
        self.send("init", {"layout": layout})

    def wrap(self, model: nn.Module, attn: AttentionBackend) -> tuple[nn.Module, AttentionBackend]:
        """The runner's model and backend on rank 0: each target call goes to the other ranks first."""
        return DriverModel(model, self), PlanRecorder(attn)

    def compact_tree_kv(self, tables: torch.Tensor, nc: torch.Tensor, accepted: torch.Tensor, path: torch.Tensor,
                        live: torch.Tensor, window_tables: torch.Tensor | None) -> None:
        """The other ranks' share of a tree compaction (ModelRunner.compact_tree_kv: each rank's pools)."""
        windows = [] if window_tables is None else [window_tables]
        self.send("kv_compact", {}, [tables, nc, accepted, path, live] + windows)

    # -- failures ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any error of a call on the group, raised as RankFailure naming the rank that failed."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            yield
        except RankFailure:
            raise
        except Exception as e:  # the ranks are out of step now: every later call fails at once
            raise RankFailure(self._explain(e)) from e

    def _explain(self, e: Exception) -> str:
        deadline = time.monotonic() + 3.0  # (a dead rank's socket often fails before its exit is seen)
        while self.failure is None and self.procs and time.monotonic() < deadline:
            self._find_dead()
            time.sleep(0.05)
        if self.failure is None:
            self.failure = f"a tensor-parallel call failed on rank 0: {type(e).__name__}: {e}"
        return self.failure

    def _find_dead(self) -> str | None:
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None and self.failure is None:
                self.failure = f"tensor-parallel rank {r} (pid {p.pid}) exited with code {code}"
        return self.failure

    def _watch(self) -> None:
        while not self.closed:
            if self._find_dead() is not None:
                if not self.closed:
                    log.error("%s: the engine cannot go on", self.failure)
                    if self.on_failure is not None:
                        self.on_failure(self.failure)
                return
            time.sleep(WATCH_INTERVAL_S)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the other ranks (they exit 0) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None:  # (in a thread: ranks stuck in another collective would never take it)
            sender = threading.Thread(target=_send_quietly, args=(self.tp, "shutdown"), daemon=True)
            sender.start()
            sender.join(timeout / 2)
        deadline = time.monotonic() + timeout / 2
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills whatever did not exit, leaves the group


def _send_quietly(tp: TPGroup, op: str) -> None:
    with contextlib.suppress(Exception):
        send_op(tp, op)


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    """Kill the ranks started here that are still running and leave the group (an engine dropped unclosed)."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class PlanRecorder(AttentionBackend):
    """Rank 0's attention backend: ``inner``'s, keeping the last planned metadata for DriverModel."""

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(inner.kv_caches, inner.block_size, inner.scale)
        self.inner = inner
        self.meta: AttentionMetadata | None = None
        self.supports_fused_rope = inner.supports_fused_rope

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.inner.plan(meta)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        return self.inner.forward(layer, q, k, v, window)

    def forward_rope(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.forward_rope(layer, qkv, cos, sin, num_heads, positions)

    def step_slots(self, num_tokens: int) -> torch.Tensor:
        return self.inner.step_slots(num_tokens)


class DriverModel(nn.Module):
    """Rank 0's target model: sends each forward (with the planned attention metadata), logits and
    embedding call to the other ranks, then runs its own shard. Everything else is the model's."""

    def __init__(self, model: nn.Module, driver: TPDriver) -> None:
        super().__init__()
        self.inner = model
        self.driver = driver

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        attn = get_forward_context().attn
        meta = attn.meta if isinstance(attn, PlanRecorder) else None
        if meta is None:
            raise RuntimeError("a tensor-parallel forward needs its attention planned through the runner's backend")
        tensors = [input_ids, positions, meta.slot_mapping, meta.block_tables]
        window = meta.window_block_tables is not None
        if window:
            tensors += [meta.window_slot_mapping, meta.window_block_tables]
        if meta.seq_shift is not None:
            tensors.append(meta.seq_shift)
        # (tree masks: built on the host, and pickled so)
        header = {"query_lens": meta.query_lens, "seq_lens": meta.seq_lens, "tree_masks": meta.tree_masks,
                  "shift": meta.seq_shift is not None, "window": window}
        with self.driver.guard():
            send_op(self.driver.tp, "forward", header, tensors)
            return self.inner(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.driver.guard():
            send_op(self.driver.tp, "logits", None, [hidden])
            return self.inner.compute_logits(hidden)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        with self.driver.guard():
            send_op(self.driver.tp, "embed", None, [ids])
            return self.inner.embed_tokens(ids)

    def set_aux_hidden_layers(self, ids: tuple[int, ...] | None) -> None:
        self.driver.send("aux", {"ids": ids})
        self.inner.set_aux_hidden_layers(ids)
