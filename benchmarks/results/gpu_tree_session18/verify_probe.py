"""Session 18 probe: the target forward of SmolLM2 (bf16, CUDA graphs) for one request of n query
tokens, causal (a chain verify) or under a tree mask (a tree verify): the attention plan's host time
and the graph replay's time, per n. Why a 17-token tree verify takes ~0.5 ms more than a 6-token chain.

    python3 benchmarks/results/gpu_tree_session18/verify_probe.py --model /tmp/m.gguf --output-file $OUT/r/verify_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from specserve import LLM  # noqa: E402
from specserve.attention.base import AttentionMetadata  # noqa: E402
from specserve.spec.tree import DraftTree  # noqa: E402


def tree_of(n: int) -> DraftTree:
    """A bushy tree of n tokens (root + n - 1 nodes): node i hangs under (i - 1) // 3."""
    parents = [-1] + [(i - 1) // 3 for i in range(1, n)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(list(range(n)), parents, depths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output-file", required=True)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=1024)
    runner = llm.engine.runner
    g, attn, dev = runner.graphs, runner.attn, llm.engine.device
    bs = llm.engine.config.block_size
    table = torch.arange(1, 1 + -(-(args.ctx + 64) // bs), dtype=torch.long, device=dev)[None]
    rows = []
    for n in [1, 2, 4, 6, 8, 9, 12, 16, 17, 20, 24, 32, 48, 64]:
        for kind in ("causal", "tree"):
            if kind == "tree" and n < 2:
                continue
            seq = args.ctx + n
            slots = torch.arange(args.ctx, seq, device=dev) + bs  # block 1 onwards
            masks = {0: tree_of(n).mask()} if kind == "tree" else None
            meta = AttentionMetadata([n], [seq], slots, table, masks)
            plan_t = []
            for _ in range(50):
                t0 = time.perf_counter()
                attn.plan(meta)
                plan_t.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            pad = g.padded_size(n)
            graph = g.graphs[pad]
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                graph.replay()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / args.iters * 1e3
            plan_ms = sorted(plan_t)[len(plan_t) // 2] * 1e3
            row = {"n": n, "kind": kind, "graph": pad, "replay_ms": ms, "plan_ms_median": plan_ms,
                   "items": attn._num_items, "merges": attn._num_merges, "block_m": attn._block_m}
            rows.append(row)
            print(row, flush=True)
    with open(args.output_file, "w") as f:
        json.dump({"ctx": args.ctx, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
