"""Session 18 probe: what one tree expansion costs on the GPU against a chain loop, replayed and
eager (kernel counts from the profiler), SmolLM2 + the shipped head, bf16, one request.

    python3 benchmarks/results/gpu_tree_session18/probe.py --model /tmp/m.gguf --output-file $OUT/r/probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from spec_single import CONFIGS, run_one  # noqa: E402
from common import chat_prompt_ids  # noqa: E402
from gpu_spec_profile import timed as time_calls  # noqa: E402

from specserve import LLM  # noqa: E402


def timed(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def kernels(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = Counter(e.name[:60] for e in evs)
    return {"kernels": len(evs), "cuda_ms": sum(e.device_time for e in evs) / 1e3, "top": names.most_common(12)}


def phases(llm: LLM, prompt: list[int]) -> dict:
    """Synchronized ms per call of the verify's and the draft's parts over one request."""
    e = llm.engine
    dr = e.drafter
    targets = [(e.runner, "prepare"), (e.runner, "forward"), (dr, "_verify_all"), (dr, "_compact"),
               (dr, "verify_step"), (dr, "draft_step"), (dr, "_catch_up")]
    times: dict[str, list[float]] = {}
    for obj, name in targets:
        time_calls(obj, name, times)
    run_one(llm, prompt, 64)
    for obj, name in targets:
        delattr(obj, name)
    return {k: {"calls": len(v), "ms_mean": 1e3 * sum(v[1:]) / max(len(v) - 1, 1)} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output-file", required=True)
    ap.add_argument("--configs", default="chain5,tree,tree8,tree4x8")
    args = ap.parse_args()
    out = {}
    for name in args.configs.split(","):
        llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=1, num_kv_blocks=1024, speculative_algorithm="EAGLE3",
                  speculative_policy="static", **CONFIGS[name])
        p = chat_prompt_ids(llm.tokenizer, 1, seed=0)[0]
        r = run_one(llm, p, 64)
        dr = llm.engine.drafter
        res = {"accept_length": r["accept_length"], "tok_s": r["tok_s"], "phases": phases(llm, p)}
        if dr.tree_runner is not None:
            tr = dr.tree_runner
            tr.load([len(p) + 10], [list(range(1, 12))], 1)
            W = tr.width([len(p) + 10])
            res["width"] = W
            res["replay_ms"] = timed(lambda: tr.graphs[(1, W)].replay())
            res["replay_ms_full_width"] = timed(lambda: tr.graphs[(1, tr.widths[-1])].replay())
            res["eager_ms"] = timed(lambda: tr._body(1, W), 50)
            res["eager_profile"] = kernels(lambda: tr._body(1, W))
        else:
            ch = dr.chain_runner
            ch.load([len(p) + 10], [5], [list(range(1, 12))], 1)
            res["replay_ms"] = timed(lambda: ch.graphs[(1, 5)].replay())
            res["eager_ms"] = timed(lambda: ch._body(1, 5), 50)
            res["eager_profile"] = kernels(lambda: ch._body(1, 5))
        out[name] = res
        print(name, {k: v for k, v in res.items() if k not in ("eager_profile", "phases")}, res["eager_profile"]["kernels"],
              res["eager_profile"]["cuda_ms"], flush=True)
        print("  ", {k: (v["calls"], round(v["ms_mean"], 3)) for k, v in res["phases"].items()}, flush=True)
        del llm, dr
    with open(args.output_file, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
