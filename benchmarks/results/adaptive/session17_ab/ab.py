"""A/B of the counterfactual tokens per arm (session 17), in one run: the adaptive engine as
committed ("adaptive") against the same engine with each cycle's counterfactual tokens dropped
("adaptive_own": an arm's tokens per request from its own cycles only, as before), beside no-spec
and static chains, stepped round robin like benchmarks/adaptive.py's sweep (its Client, run_point).

    python benchmarks/results/adaptive/session17_ab/ab.py --concurrency 1,1,1 --output-file X.json

Ran at f6b6475, 15430bb and 2211507; the counterfactual tokens were reverted after these A/Bs, so at
later commits both adaptive engines are the same. ``run_ab`` (the harness, shared with ab_seeds.py)
was split out afterwards with the same behaviour.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from adaptive import Client, STATIC, prompt_pool, run_point, run_side_by_side  # noqa: E402
from common import run_metadata, wait_for_quiet  # noqa: E402

from specserve import LLM  # noqa: E402
from specserve.engine.heap import freeze_startup_heap  # noqa: E402


def warm_up(clients: list[Client], pool: list) -> None:
    """Two short requests through each engine (allocator, kernels, first acceptance observations),
    then the start-up heap frozen as the server does; the sweep's prompts start at pool[2]."""
    warm = [(p, 8) for p, _ in pool[:2]]
    for c in clients:
        c.reset()
        run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)
    freeze_startup_heap()


def run_ab(b_name: str, patch_b: Callable[[LLM], None], benchmark: str) -> None:
    """The committed adaptive engine ("adaptive") against one changed by ``patch_b`` (``b_name``),
    beside no-spec and static chains; writes --output-file after every point."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,1,1")
    ap.add_argument("--point-s", type=float, default=40.0)
    ap.add_argument("--static-steps", default="2,3")
    ap.add_argument("--adaptive-steps", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-wait", type=float, default=30.0)
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cs = [int(x) for x in args.concurrency.split(",")]
    adaptive = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive",
                "speculative_num_steps": args.adaptive_steps, "speculative_calibrate": True}
    cfgs = {"none": {}, **{f"chain{k}": {**STATIC, "speculative_num_steps": int(k)} for k in args.static_steps.split(",")},
            "adaptive": adaptive, b_name: adaptive}
    llms = {n: LLM(args.model, kv_cache_memory_gb=0.75, max_num_seqs=max(max(cs), 8), seed=0,
                   num_kv_blocks=args.num_kv_blocks, **kw) for n, kw in cfgs.items()}
    patch_b(llms[b_name])
    clients = [Client(n, llm) for n, llm in llms.items()]
    pool = prompt_pool(llms["none"].tokenizer, 600, args.max_input_len, args.output_len, 0)
    warm_up(clients, pool)
    offset, points = 2, []
    for C in cs:
        wait_for_quiet(0.3, args.max_wait)
        off = offset
        p = run_point(clients, C, lambda i: pool[(off + i) % len(pool)], args.point_s)
        offset += max(c.issued for c in clients)
        cf = p["configs"]
        best = max(cf[n]["tok_s"] for n in cf if not n.startswith("adaptive"))
        p["ratios"] = {n: cf[n]["tok_s"] / best for n in ("adaptive", b_name)}
        points.append(p)
        print(f"C={C}: " + " | ".join(f"{n} {cf[n]['tok_s']:.1f}" + (f" k{cf[n]['mean_k']:.2f}" if cf[n].get('mean_k') is not None else "")
                                     for n in cf) + " | ratios " + json.dumps({k: round(v, 3) for k, v in p["ratios"].items()}), flush=True)
        out = {"benchmark": benchmark, **run_metadata(), "command": "python " + " ".join(sys.argv),
               "settings": vars(args), "points": points,
               "controllers": {n: llms[n].engine.drafter.controller.snapshot() for n in ("adaptive", b_name)}}
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:  # after every point: a run cut short keeps what it measured
            json.dump(out, f, indent=1, default=str)


def own_cycle_tokens(llm: LLM) -> None:
    """The B side: no counterfactual tokens reach the bandit (Cycle.alt_depths stays None)."""
    llm.engine.drafter.controller._counterfactual = lambda *a, **k: None


if __name__ == "__main__":
    run_ab("adaptive_own", own_cycle_tokens, "adaptive_counterfactual_ab")
