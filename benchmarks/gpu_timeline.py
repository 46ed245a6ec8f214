"""Where the GPU waits for the host: one request's steps on a timeline (torch.profiler), per engine phase.

Issue #8: at one request on the H200 a chain-5 cycle took 2.67 ms of wall time while the GPU ran
kernels for 1.31 of them (`gpu_step_breakdown.py --profile`). This traces a few steps of each
configuration with the engine's phases labelled (record_function), then walks the timeline: every
stretch where no kernel or copy runs on the device is charged to the innermost labelled host phase
running through it (a gap across phases is split at their edges); "engine.step" is engine code
outside the other labelled phases.

Caveat, measured (results/gpu_session25/launch_probe_*.json): with the profiler attached a graph
launch holds the host ~0.7 us per kernel node (~220 us for the target's 310) and the device starts
only after it returns; without it a launch takes 6-16 us. Idle time charged to phases that launch
graphs (runner.forward, the draft runners' run) is mostly the profiler's own; read the other phases.

    python benchmarks/gpu_timeline.py --model /tmp/m.gguf --configs nospec,static_chain5 \
        --output-file benchmarks/results/gpu_timeline.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import sys
import tempfile
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chat_prompt_ids, run_metadata, write_json  # noqa: E402
from gpu_adaptive import engine_args  # noqa: E402
from spec_single import DEFAULT_HEAD  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402

# (object path from the engine, method): the phases labelled on the timeline
PHASES = [("", "step"), ("scheduler", "schedule"), ("scheduler", "commit"), ("", "_output"),
          ("runner", "prepare"), ("runner", "forward"), ("runner", "launch_sampling"), ("runner", "execute"),
          ("runner", "launch"),
          ("drafter", "verify_step"), ("drafter", "draft_step"), ("drafter.catch_up", "__call__"),
          ("drafter.proposer", "propose"), ("drafter", "_accept"),
          ("drafter", "_record"), ("drafter.features", "keep_plain"), ("drafter.cycle", "draft"),
          ("drafter.proposer.chain_runner", "run"), ("drafter.catch_up.runner", "run"), ("", "_detokenize")]


def label(llm: LLM) -> list[tuple[Any, str]]:
    """Wrap each phase in a record_function of its name; returns what to undo."""
    done = []
    for path, name in PHASES:
        obj = llm.engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        fn: Callable | None = getattr(obj, name, None) if obj is not None else None
        if fn is None:
            continue
        tag = f"{path or 'engine'}.{name}"

        def wrapped(*a: Any, _fn: Callable = fn, _tag: str = tag, **kw: Any) -> Any:
            with torch.profiler.record_function(_tag):
                return _fn(*a, **kw)

        setattr(obj, name, wrapped)
        done.append((obj, name))
    return done


def analyse(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Device busy time, and the idle gaps charged to the innermost host phase running through them."""
    ev = trace["traceEvents"]
    dev = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in ev
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    spans = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).split(".")[0] in ("engine", "scheduler", "runner", "drafter")]
    tops = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "engine.step")
    if not tops or not dev:
        return {"error": "no engine steps or no device events in the trace"}
    t0, t1 = tops[0][0], tops[-1][1]
    # merge device intervals inside the traced steps
    busy: list[list[float]] = []
    for a, b in dev:
        a, b = max(a, t0), min(b, t1)
        if b <= a:
            continue
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    busy_us = sum(b - a for a, b in busy)
    gaps, prev = [], t0
    for a, b in busy:
        if a > prev:
            gaps.append((prev, a))
        prev = max(prev, b)
    if t1 > prev:
        gaps.append((prev, t1))
    spans.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in spans]
    edges = sorted({e["ts"] for e in spans} | {e["ts"] + e["dur"] for e in spans})

    def innermost(t: float) -> str:
        inner, best = "outside engine.step", None
        for e in spans[: bisect.bisect_right(starts, t)]:
            if e["ts"] <= t <= e["ts"] + e["dur"] and (best is None or e["dur"] < best):
                inner, best = e["name"], e["dur"]
        return inner

    idle_by: dict[str, float] = collections.defaultdict(float)
    for a, b in gaps:  # a gap across phase boundaries is split at them
        cuts = [a] + edges[bisect.bisect_right(edges, a) : bisect.bisect_left(edges, b)] + [b]
        for x, y in zip(cuts, cuts[1:]):
            idle_by[innermost((x + y) / 2)] += y - x
    wall = t1 - t0
    host_by: dict[str, float] = collections.defaultdict(float)
    for e in spans:
        host_by[e["name"]] += e["dur"]
    return {"steps": steps, "wall_ms_per_step": round(wall / 1e3 / steps, 4),
            "device_busy_ms_per_step": round(busy_us / 1e3 / steps, 4),
            "device_idle_ms_per_step": round((wall - busy_us) / 1e3 / steps, 4),
            "idle_ms_per_step_by_host_phase": {k: round(v / 1e3 / steps, 4)
                                               for k, v in sorted(idle_by.items(), key=lambda kv: -kv[1])},
            "host_phase_ms_per_step": {k: round(v / 1e3 / steps, 4)
                                       for k, v in sorted(host_by.items(), key=lambda kv: -kv[1])}}


def trace_one(llm: LLM, prompt: list[int], output_len: int, keep: str | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)  # warm: graphs, caches
    undo = label(llm)
    before = llm.engine.stats.steps
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], sp, use_tqdm=False)
    finally:
        for obj, name in reversed(undo):
            delattr(obj, name)
    steps = llm.engine.stats.steps - before
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    if keep:
        with gzip.open(keep, "wt") as f:
            json.dump(trace, f)
    return analyse(trace, steps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="SmolLM2 GGUF ('default' for the packaged one)")
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--configs", default="nospec,static_chain5")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--keep-traces", default=None, help="folder for each configuration's trace (.json.gz)")
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"benchmark": "gpu_timeline", **run_metadata(), "settings": vars(args), "configs": {}}
    prompt = None
    for name in args.configs.split(","):
        llm = LLM(**engine_args(name, args.model, args.head, 1, args.num_kv_blocks))
        if prompt is None:
            prompt = chat_prompt_ids(llm.tokenizer, 1, seed=0)[0]
        keep = os.path.join(args.keep_traces, f"{name}.json.gz") if args.keep_traces else None
        if keep:
            os.makedirs(args.keep_traces, exist_ok=True)
        got = trace_one(llm, prompt, args.output_len, keep)
        print(name, json.dumps(got))
        result["configs"][name] = got
        del llm
    write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
