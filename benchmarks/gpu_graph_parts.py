"""Device time of each CUDA graph a one-request speculative cycle replays (the H200's C = 1 path),
against the engine's wall time per cycle: which part of a cycle the device spends where, and how
much of the cycle is host time.

For each configuration: an engine (static policy, bf16, one request) generates ``--output-len``
tokens for one ShareGPT prompt (ignore_eos), then every graph the cycle used is replayed
``--reps`` times between CUDA events with the static buffers as the last step left them: the
target at the verify's token count, the fused launch (chains: FusedLaunchRunner; trees:
FusedTreeLaunch), the expansion / chain loop alone.

    python benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs chain5,tree,tree8 --output-file out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chat_prompt_ids, device_ms, run_metadata, write_json  # noqa: E402
from spec_single import CONFIGS, DEFAULT_HEAD  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402


def kernels(graph: torch.cuda.CUDAGraph, reps: int = 20, top: int = 30) -> list[dict]:
    """The kernels one replay of ``graph`` runs, by device time (the profiler traces a graph's kernels
    where CUPTI can): name, launches per replay, microseconds per replay."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us > 0:
            rows.append({"name": ev.key[:120], "per_replay": ev.count / reps, "us": us / reps})
    rows.sort(key=lambda r: -r["us"])
    total = {"name": "(all kernels)", "per_replay": sum(r["per_replay"] for r in rows), "us": sum(r["us"] for r in rows)}
    return [total] + rows[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--head", default=str(DEFAULT_HEAD))
    ap.add_argument("--configs", default="chain5,tree")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--kernels", action="store_true",
                    help="also the kernels of the one-request fused launch and expansion / chain loop, by device time")
    ap.add_argument("--output-file", default="benchmarks/results/gpu_graph_parts.json")
    args = ap.parse_args(argv)
    prompt = None
    rows = {}
    for name in args.configs.split(","):
        spec = dict(CONFIGS[name])
        llm = LLM(model=None if args.model == "default" else args.model, dtype="bfloat16", max_num_seqs=1,
                  num_kv_blocks=1024, speculative_algorithm="EAGLE3", speculative_draft_model_path=args.head,
                  speculative_policy="static", **spec)
        if prompt is None:
            prompt = chat_prompt_ids(llm.tokenizer, 1, seed=0)[0]
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([prompt], sp)  # warm-up
        e, dr = llm.engine, llm.engine.drafter
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp)
        wall = time.perf_counter() - t0
        n_tok = len(out[0].outputs[0].token_ids)
        K = dr.max_k + 1
        g = e.runner.graphs
        row = {"tokens": n_tok, "wall_s": wall, "tok_s": n_tok / wall,
               "target_ms": {n: device_ms(g.graphs[n], args.reps) for n in g.sizes if n <= max(32, K)},
               "verify_tokens": K}
        if dr.pipeline.tree_launch is not None:
            tl = dr.pipeline.tree_launch
            row["fused_tree_launch_ms"] = {str(k): device_ms(gr, args.reps) for k, gr in tl.graphs.items() if k[0] == 1}
            row["expansion_ms"] = {str(k): device_ms(gr, args.reps) for k, gr in dr.proposer.tree_runner.graphs.items() if k[0] == 1}
        if dr.pipeline.fused_launch is not None:
            fl = dr.pipeline.fused_launch
            row["fused_launch_ms"] = {str(k): device_ms(gr, args.reps) for k, gr in fl.graphs.items()
                                      if k[1] == 1 and k[2] == dr.max_k and k[3] == dr.max_k}
            row["chain_ms"] = {str(k): device_ms(gr, args.reps) for k, gr in dr.proposer.chain_runner.graphs.items() if k[0] == 1}
        if args.kernels:
            parts = {}
            if dr.pipeline.tree_launch is not None:
                parts["fused_tree_launch"] = next(gr for k, gr in dr.pipeline.tree_launch.graphs.items() if k[0] == 1)
                parts["expansion"] = next(gr for k, gr in dr.proposer.tree_runner.graphs.items() if k[0] == 1)
            if dr.pipeline.fused_launch is not None:
                parts["fused_launch"] = next(gr for k, gr in dr.pipeline.fused_launch.graphs.items()
                                             if k[1] == 1 and k[2] == dr.max_k and k[3] == dr.max_k)
                parts["chain"] = next(gr for k, gr in dr.proposer.chain_runner.graphs.items() if k[0] == 1)
            row["kernels"] = {p: kernels(gr) for p, gr in parts.items()}
            for p, ks in row["kernels"].items():
                print(f"  {name} {p}: {ks[0]['per_replay']:.0f} launches, {ks[0]['us']:.0f} us", flush=True)
                for k in ks[1:13]:
                    print(f"    {k['us']:7.1f} us {k['per_replay']:5.1f}x {k['name'][:90]}", flush=True)
        row["paths"] = dict(dr.path_counts)
        rows[name] = row
        print(name, {k: v for k, v in row.items() if k not in ("paths", "kernels")}, flush=True)
        del llm
        torch.cuda.empty_cache()
    write_json(args.output_file, {"meta": run_metadata(), "configs": rows, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
