"""Session 19 probe: does the bandit measure every depth's cycles alike? Adaptive engines held at
depth 0, 1, 2 (controller.forced_arm) beside no-spec at one concurrency, stepped round robin
(adaptive.py's Client, run_point). Every cycle the controller ends is logged (arm, seconds as
measured, the prompt tokens' predicted share it subtracts, tokens, whether it counts); per engine:
the bandit's view (tokens over measured seconds, counted cycles only) against the engine's real
output tok/s over the same window.

    python benchmarks/results/adaptive/session19_probe/cycle_bias.py --concurrency 32 --point-s 40 \
        --output-file X.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import warm_up  # noqa: E402  (also puts the repository and benchmarks/ on the path)
from adaptive import Client, prompt_pool, run_point  # noqa: E402
from common import run_metadata, wait_for_quiet  # noqa: E402

from specserve import LLM  # noqa: E402


def log_cycles(llm: LLM, arm: int, logs: dict[str, list], name: str) -> None:
    """Hold ``llm`` at ``arm``; every cycle it ends goes to ``logs[name]`` (the list there then)."""
    ctl = llm.engine.drafter.controller
    ctl.forced_arm = arm
    orig = ctl.finish_cycle

    def finish(c, seconds):
        if c is not None and c.tokens > 0:
            logs[name].append({"arm": c.arm, "seconds": seconds, "prefill_s": c.prefill_seconds, "tokens": c.tokens,
                        "requests": c.requests, "measured": c.measured,
                        "counted": c.measured and c.prefill_seconds <= ctl.prefill_share_limit * seconds})
        return orig(c, seconds)
    ctl.finish_cycle = finish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="32")
    ap.add_argument("--point-s", type=float, default=40.0)
    ap.add_argument("--arms", default="0,1,2")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cs = [int(x) for x in args.concurrency.split(",")]
    arms = [int(x) for x in args.arms.split(",")]
    adaptive = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive", "speculative_num_steps": 3}
    llms = {"none": LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=max(max(cs), 8), seed=0)}
    logs: dict[str, list] = {}
    for a in arms:
        llms[f"held{a}"] = LLM(None, kv_cache_memory_gb=0.75, max_num_seqs=max(max(cs), 8), seed=0, **adaptive)
        logs[f"held{a}"] = []
        log_cycles(llms[f"held{a}"], a, logs, f"held{a}")
    clients = [Client(n, llm) for n, llm in llms.items()]
    pool = prompt_pool(llms["none"].tokenizer, 600, args.max_input_len, args.output_len, 0)
    warm_up(clients, pool)
    offset, points = 2, []
    for C in cs:
        for a in arms:
            logs[f"held{a}"] = []  # this point's cycles only
        wait_for_quiet(0.3, 30)
        off = offset
        p = run_point(clients, C, lambda i: pool[(off + i) % len(pool)], args.point_s)
        offset += max(c.issued for c in clients)
        view = {}
        for n, log in logs.items():
            cnt = [x for x in log if x["counted"]]
            clean = [x for x in log if x["counted"] and x["prefill_s"] == 0]
            sec = sum(max(x["seconds"] - x["prefill_s"], 0.2 * x["seconds"]) for x in cnt)
            view[n] = {"cycles": len(log), "counted": len(cnt), "clean": len(clean),
                       "bandit_tok_s": sum(x["tokens"] for x in cnt) / sec if sec else None,
                       "clean_tok_s": sum(x["tokens"] for x in clean) / sum(x["seconds"] for x in clean) if clean else None,
                       "all_cycles_tok_s": sum(x["tokens"] for x in log) / sum(x["seconds"] for x in log) if log else None,
                       "real_tok_s": p["configs"][n]["tok_s"]}
        p["bandit_view"] = view
        p["cycle_logs"] = dict(logs)
        points.append(p)
        print(f"C={C}: none {p['configs']['none']['tok_s']:.1f} | " + " | ".join(
            f"{n}: real {v['real_tok_s']:.1f} bandit {v['bandit_tok_s']:.1f} clean {v['clean_tok_s'] or 0:.1f} "
            f"all {v['all_cycles_tok_s']:.1f} ({v['counted']}/{v['cycles']} counted, {v['clean']} clean)"
            for n, v in view.items()), flush=True)
        with open(args.output_file, "w") as f:
            json.dump({"benchmark": "cycle_bias", **run_metadata(), "command": "python " + " ".join(sys.argv),
                       "settings": vars(args), "points": points}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
