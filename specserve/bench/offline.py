"""The offline side of a served-vs-offline comparison: the engine stepped directly, in a process of its own.

    side = OfflineProcess(config, reserved_cores=1)   # spawned; set up as the engine core sets itself up
    info = side.wait_ready()                           # pid, device, model, tokenizer, CPU threads
    results, duration, steps = side.run(prompts, max_tokens=[256] * n, concurrency=64)
    side.stop()

The child builds its engine through engine/process.py:own_engine, as the server's engine core does (the
same CPU threads for the same reserved cores, the start-up heap frozen), so the two sides differ only by
what serving adds. Its timed loop is a closed loop of C requests in flight (as `LLM.chat` with
max_num_seqs=C): step until done, recording per request what the serving client records per chunk
(a "chunk" is what a request gained in one step). Results come back over a pipe after the loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

from specserve.bench.metrics import RequestResult
from specserve.speculative.policy.bandit import batch_key, bucket_batch


@dataclass
class StepStats:
    """The engine's steps in one run: all of them, and those taken with all C requests in flight."""

    steps: int
    steady_steps: int
    mean_step_ms: float | None  # mean time of an engine.step() call at the steady batch
    k_counts: dict[int, int] | None = None  # request-decisions per draft depth (None: no speculation)
    path_counts: dict[str, int] | None = None  # the drafter's calls per path ("fused", "unfused:k", ...)
    explorations: int | None = None  # the adaptive policy's exploration decisions
    # per batch (requests in flight, bucketed as the adaptive policy's table) and kind ("verify": the step verified
    # drafts; "switch": a plain step right after one, which no step launched ahead; "plain"): [steps, seconds,
    # output tokens]
    by_batch: dict[int, dict[str, list[float]]] | None = None
    goodput: dict | None = None  # the adaptive policy's table after the run and its pick changes in it

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "steady_steps": self.steady_steps, "mean_step_ms": self.mean_step_ms,
                "k_counts": self.k_counts, "path_counts": self.path_counts, "explorations": self.explorations,
                "by_batch": self.by_batch, "goodput": self.goodput}


def run_offline(engine: Any, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                temperature: float = 0.0, ignore_eos: bool = False) -> tuple[list[RequestResult], float, StepStats]:
    """Closed loop of ``concurrency`` requests in flight, the prompts in order; (results, duration s, steps)."""
    from specserve.sampling_params import RequestOutputKind, SamplingParams

    results = [RequestResult(index=i, expected_output_len=n, client_prompt_len=len(p))
               for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    index: dict[str, int] = {}
    next_i, steps, steady_steps, steady_time = 0, 0, 0, 0.0
    last_verified = False
    k_before = engine.get_stats().k_histogram
    drafter = engine.drafter
    paths_before = Counter(drafter.path_counts) if drafter is not None else Counter()
    explored_before = drafter.controller.explorations if drafter is not None else 0
    turns_before = drafter.controller.bandit.turns if drafter is not None else 0
    stats = engine.stats
    by_batch: dict[int, dict[str, list[float]]] = {}
    t0 = time.perf_counter()
    while next_i < len(prompts) or index:
        while next_i < len(prompts) and len(index) < concurrency:
            rid = f"offline-{concurrency}-{next_i}"
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens[next_i], ignore_eos=ignore_eos,
                                    output_kind=RequestOutputKind.DELTA)
            results[next_i].start = time.perf_counter()
            engine.add_request(rid, prompts[next_i], params)
            index[rid] = next_i
            next_i += 1
        steady = len(index) == concurrency
        batch, spec_steps = len(index), stats.spec_steps
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        if steady:
            steady_steps, steady_time = steady_steps + 1, steady_time + (now - s0)
        verified = stats.spec_steps > spec_steps
        kind = "verify" if verified else "switch" if last_verified else "plain"
        last_verified = verified
        row = by_batch.setdefault(bucket_batch(batch_key(batch)), {}).setdefault(kind, [0, 0.0, 0])
        row[0] += 1
        row[1] += now - s0
        for out in outs:
            r = results[index[out.request_id]]
            n = len(out.new_token_ids)
            row[2] += n
            if n:
                if r.ttft is None:
                    r.ttft = now - r.start
                r.chunk_times.append(now)
                r.chunk_tokens.append(n)
            if out.finished:
                del index[out.request_id]
                m = out.metrics
                r.latency, r.success, r.finish_reason = now - r.start, True, out.outputs[0].finish_reason
                r.usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": sum(r.chunk_tokens),
                           "spec_verify_steps": m.spec_verify_steps, "spec_draft_tokens": m.spec_draft_tokens,
                           "spec_accepted_tokens": m.spec_accepted_tokens}
    duration = time.perf_counter() - t0
    k_after = engine.get_stats().k_histogram
    k_counts = dict(sorted((Counter(k_after) - Counter(k_before)).items())) or None
    paths = dict(sorted((Counter(drafter.path_counts) - paths_before).items())) if drafter is not None else None
    explored = drafter.controller.explorations - explored_before if drafter is not None else None
    goodput = None
    if drafter is not None and drafter.cfg.policy == "adaptive":
        snap = drafter.controller.snapshot()
        goodput = {"table": snap["measured_goodput"], "budget": snap["exploration_budget"],
                   "pick_changes": drafter.controller.bandit.pick_changes(turns_before)}
    return results, duration, StepStats(steps, steady_steps, steady_time / steady_steps * 1e3 if steady_steps else None,
                                        k_counts, paths or None, explored, dict(sorted(by_batch.items())), goodput)


def _device_name(engine: Any) -> str:
    import torch

    device = engine.device
    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _child(config: Any, reserved_cores: int, conn: Any, log_level: int) -> None:
    """The offline process: build the engine as the engine core does, then run what the parent asks."""
    import torch

    from specserve.engine.process import own_engine
    from specserve.server.engine_core import build_engine

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = own_engine(partial(build_engine, config), reserved_cores)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    tok = engine.tokenizer
    conn.send(("ready", {"pid": os.getpid(), "device": _device_name(engine), "model": engine.model_name,
                         "dtype": str(engine.dtype).replace("torch.", ""), "torch": torch.__version__,
                         "cpu_threads": torch.get_num_threads(), "tokenizer": tok,
                         "calibration": engine.drafter.calibration if engine.drafter is not None else None}))
    chats: dict[str, list[int]] = {}
    while (msg := conn.recv()) is not None:
        texts, max_tokens, concurrency, ignore_eos = msg
        for t in texts:  # the chat template, as a front-end applies it: before the timed loop
            if t not in chats:
                chats[t] = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        conn.send(run_offline(engine, [chats[t] for t in texts], max_tokens, concurrency, ignore_eos=ignore_eos))
    if hasattr(engine, "close"):
        engine.close()


class OfflineProcess:
    """An engine for ``config`` in a spawned process (see the module's docstring); ``reserved_cores``: what
    the served side's engine core keeps for its front-ends, so that both get the same CPU threads."""

    def __init__(self, config: Any, reserved_cores: int, log_level: int = logging.WARNING) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(config, reserved_cores, child, log_level),
                                name="specserve-offline", daemon=True)
        self.proc.start()
        child.close()

    def _recv(self) -> Any:
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise RuntimeError(f"the offline engine's process exited (code {self.proc.exitcode})") from None

    def wait_ready(self) -> dict[str, Any]:
        """The engine's description (pid, device, dtype, model, torch, cpu_threads, tokenizer) once built."""
        kind, payload = self._recv()
        if kind != "ready":
            raise RuntimeError(f"the offline engine failed to start: {payload}")
        return payload

    def run(self, prompts: list[str], max_tokens: list[int], concurrency: int,
            ignore_eos: bool = False) -> tuple[list[RequestResult], float, StepStats]:
        """Chat prompts (the user's turn) as a closed loop of ``concurrency``; (results, duration s, steps)."""
        self.conn.send((prompts, max_tokens, concurrency, ignore_eos))
        return self._recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
