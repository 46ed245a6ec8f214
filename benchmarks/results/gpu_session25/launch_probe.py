"""How long cudaGraphLaunch keeps the host, per graph (no profiler attached), against the graph's GPU time.

Session 25: under torch.profiler the target graph's launch (310 nodes) took ~220 us at one request
and the first kernel started only after it returned. This measures the same without the profiler,
for the engine's three graphs at one request (target 1 token, catch-up, chain of 5) and for
synthetic straight-line graphs of N torch kernels and N Triton kernels.

    python launch_probe.py --model /tmp/m.gguf --output-file launch_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
from specserve import LLM, SamplingParams  # noqa: E402


@triton.jit
def _inc(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)


def time_graph(g: torch.cuda.CUDAGraph, reps: int = 200) -> dict:
    launch, total = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        total.append(t2 - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    back = (time.perf_counter() - t0) / reps
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(50):
        e0.record(); g.replay(); e1.record(); e1.synchronize()  # noqa: E702
        gpu.append(e0.elapsed_time(e1) / 1e3)
    us = lambda v: round(1e6 * v, 1)  # noqa: E731
    return {"launch_us_median": us(statistics.median(launch)), "launch_plus_run_us_median": us(statistics.median(total)),
            "back_to_back_us_per_replay": us(back), "gpu_event_us_median": us(statistics.median(gpu))}


def synthetic(n: int, kind: str) -> torch.cuda.CUDAGraph:
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            _inc[(1,)](x, 1024, BLOCK=1024)
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            if kind == "triton":
                _inc[(1,)](x, 1024, BLOCK=1024)
            else:
                x.add_(1)
    g._keep = x  # noqa: SLF001
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args()
    out: dict = {"torch": torch.__version__, "triton": triton.__version__,
                 "driver": torch.cuda.get_device_name(), "synthetic": {}, "engine": {}}
    for n in (32, 100, 300):
        for kind in ("torch", "triton"):
            out["synthetic"][f"{kind}_{n}"] = time_graph(synthetic(n, kind))
            print(kind, n, out["synthetic"][f"{kind}_{n}"], flush=True)
    head = os.path.normpath(os.path.join(HERE, "..", "..", "..", "models", "smollm2-135m-eagle3"))
    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head, speculative_eagle_topk=1, speculative_num_steps=5,
              speculative_policy="static")
    llm.generate(["Tell me about the moon."], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    d = llm.engine.drafter
    graphs = {"target_1": llm.engine.runner.graphs.graphs[1]}
    graphs["catch_up_" + str(min(d.catch_up_runner.graphs))] = d.catch_up_runner.graphs[min(d.catch_up_runner.graphs)]
    graphs["chain_1x5"] = d.chain_runner.graphs[(1, 5)]
    for name, g in graphs.items():
        out["engine"][name] = time_graph(g)
        print(name, out["engine"][name], flush=True)
    # the engine's order: target, catch-up, chain, target, ... each launched on an idle device
    seq: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(200):
        for name, g in graphs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            seq[name].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out["alternating_launch_us_median"] = {n: round(1e6 * statistics.median(v), 1) for n, v in seq.items()}
    print("alternating", out["alternating_launch_us_median"], flush=True)
    # inside the engine: every CUDAGraph.replay call timed while it generates (no profiler attached)
    calls: list[float] = []
    orig = torch.cuda.CUDAGraph.replay

    def timed(self: torch.cuda.CUDAGraph) -> None:
        t0 = time.perf_counter()
        orig(self)
        calls.append(time.perf_counter() - t0)

    torch.cuda.CUDAGraph.replay = timed
    try:
        llm.generate(["Write a story about a cat who learns to fly."],
                     SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        torch.cuda.CUDAGraph.replay = orig
    calls.sort()
    out["in_engine_replay_us"] = {"calls": len(calls), "median": round(1e6 * calls[len(calls) // 2], 1),
                                  "p90": round(1e6 * calls[int(len(calls) * 0.9)], 1),
                                  "mean": round(1e6 * sum(calls) / len(calls), 1)}
    print("in engine", out["in_engine_replay_us"], flush=True)
    with open(args.output_file, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
