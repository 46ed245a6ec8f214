"""Device time of the target's attention for one request's verify step, per tree mode (issue #8).

Session 36: at C = 1 a tree-32 cycle took ~0.13 ms more with exact trees than with shared tiles,
and sharing the ranges below the tree (``share_tree_prefix``) did not change that.
This times the attention alone, SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64, bf16,
16-token pages), ``--layers`` launches captured in one CUDA graph as the engine's verify graph
has them (the grid of a graph for 25..32 tokens; exact modes with the EXACT kernel), for:
  decode   one token, causal (plain decoding's step: the floor),
  shared   the tree as tiles of five tokens (exact_trees=False),
  exact    each tree token alone over its one-token decode ranges (the default),
  prefix   exact, ranges wholly below the tree shared by tiles of several tokens.
With ``--module FILE`` a second copy of ``triton_backend.py`` (e.g. the previous commit's) is timed
beside this tree's, interleaved, for A/Bs of the kernel. Also the host time of ``plan``.

    python benchmarks/gpu_tree_attention.py --seq-lens 100,500,1000,2000 --output-file out.json
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_ms, run_metadata, write_json  # noqa: E402

from specserve.attention import triton_backend  # noqa: E402
from specserve.attention.base import AttentionMetadata  # noqa: E402
from specserve.engine.cuda_graph import CAPTURE_SIZES  # noqa: E402
from specserve.speculative.tree import DraftTree  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def tree_mask(n: int, topk: int = 4) -> torch.Tensor:
    """A tree like EAGLE's top-k expansion: each node's children are the next free indices, breadth
    first, up to ``topk`` children for the first nodes of each level."""
    parents = [-1]
    frontier = [0]
    while len(parents) < n:
        nxt = []
        for p in frontier:
            for _ in range(topk):
                if len(parents) == n:
                    break
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier = nxt[:topk]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree([0] * n, parents, depths).mask()


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("triton_backend_b", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(mod, mode: str, seq_len: int, tree_tokens: int, caches, device) -> tuple:
    exact = mode in ("exact", "prefix")
    be = mod.TritonBackend(caches, PAGE, HEAD_DIM**-0.5, num_heads=HEADS, max_num_tokens=2048, max_num_seqs=4,
                           max_blocks_per_seq=-(-(seq_len + 64) // PAGE), exact_trees=exact,
                           share_tree_prefix=mode == "prefix")
    q = 1 if mode == "decode" else tree_tokens
    bt = torch.arange(-(-seq_len // PAGE), dtype=torch.int32, device=device)[None]
    meta = AttentionMetadata(query_lens=[q], seq_lens=[seq_len], block_tables=bt,
                             slot_mapping=torch.arange(seq_len - q, seq_len, device=device),
                             tree_masks=None if mode == "decode" else {0: tree_mask(q)})
    return be, meta, q


def time_mode(mod, mode: str, seq_len: int, args, caches, device) -> dict:
    be, meta, q = build(mod, mode, seq_len, args.tree_tokens, caches, device)
    # the engine's graph for q tokens: the next captured size up, replayed by steps above the one below
    i = bisect.bisect_left(CAPTURE_SIZES, q)
    n = CAPTURE_SIZES[i]
    be.graph_min_tokens = CAPTURE_SIZES[i - 1] + 1 if i else 1
    be.capture_exact = be.exact_trees
    be.plan(meta)
    qt = torch.randn(n, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    for layer in range(args.layers):  # compile, warm
        be._attend(layer, qt)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(args.layers):
            be._attend(layer, qt)
    be.graph_min_tokens = 1
    be.capture_exact = False
    plan_s = []
    for _ in range(args.plan_reps):
        t0 = time.perf_counter()
        be.plan(meta)
        plan_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    us_per_layer = device_ms(graph, args.reps) * 1e3 / args.layers
    return {"device_us_per_layer": us_per_layer,
            "plan_us_median": statistics.median(plan_s) * 1e6, "items": be._num_items, "merges": be._num_merges,
            "exact_step": bool(be.step_exact), "graph_tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="100,500,1000,2000")
    ap.add_argument("--tree-tokens", type=int, default=32)
    ap.add_argument("--modes", default="decode,shared,exact,prefix")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--plan-reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    ap.add_argument("--module", default=None, help="a second triton_backend.py to time beside this tree's")
    ap.add_argument("--output-file", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    mods = {"this": triton_backend}
    if args.module:
        mods["b"] = load_module(args.module)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    num_blocks = -(-(max(seq_lens) + 64) // PAGE) + 1
    caches = [(torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
               torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16))
              for _ in range(args.layers)]
    samples: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for s in seq_lens:
            for mode in args.modes.split(","):
                for name, mod in mods.items():
                    samples.setdefault(f"{name}/{mode}/{s}", []).append(time_mode(mod, mode, s, args, caches, device))
    rows = []
    for key, runs in samples.items():
        name, mode, s = key.split("/")
        row = dict(runs[0], module=name, mode=mode, seq_len=int(s),
                   device_us_per_layer=statistics.median(r["device_us_per_layer"] for r in runs),
                   plan_us_median=statistics.median(r["plan_us_median"] for r in runs),
                   device_us_rounds=[round(r["device_us_per_layer"], 2) for r in runs])
        rows.append(row)
        print(f"{name:5s} {mode:7s} seq {s:5s}: {row['device_us_per_layer']:6.2f} us/layer "
              f"({row['device_us_per_layer'] * args.layers:6.1f} us for {args.layers}), plan {row['plan_us_median']:6.1f} us,"
              f" items {row['items']}, merges {row['merges']}", flush=True)
    if args.output_file:
        write_json(args.output_file, {**run_metadata(), "benchmark": "gpu_tree_attention", "args": vars(args),
                                      "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
