"""C = 1 speculation on the GPU with the real SmolLM2 and the shipped head (issue #8's goals:
speculation >= 2.5x no-spec tok/s at C = 1; greedy spec == no-spec on >= 95% of 50 prompts in
bf16, 100% in fp32).

1. Throughput, bf16, greedy, ``--output-len`` tokens (ignore_eos, or up to the model's own end
   of turn with ``--natural-stops``) per prompt, each of
   ``--num-prompts`` ShareGPT chat prompts alone through no-spec / chain k=3 / chain k=5 / tree
   (static policy), the order rotating per prompt; per prompt tok/s, accept length and the
   engine steps, then medians and the speedup over no-spec.
2. Step breakdown: one more prompt per configuration with synchronized timers around the target
   verify (``verify_step`` / ``execute``) and the draft step (catch-up + draft loop): ms per step.
   (Separate pass: the synchronizing timers would change the throughput numbers.)
3. Greedy parity, spec (chain k=3) vs no-spec on ``--parity-prompts`` prompts, C = 1, in bf16 and
   in fp32: how many agree token for token, and where the others first diverge.

Every engine counts which path each forward took (target: CUDA graph or eager; draft: catch-up
and chain loop, graph or eager). A decode step that ran eagerly is a fallback: the script
records it and exits with status 1 (after writing the JSON) instead of reporting slow numbers
as if they were the graph path (the tree's expansion included: a graph per padded batch).

    python benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --output-file $OUT/gpu_spec_c1.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import Counter
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specserve.bench.harness import chat_prompt_ids, median, run_metadata, write_json  # noqa: E402
from spec_single import CONFIGS, DEFAULT_HEAD, head_provenance, run_one  # noqa: E402

from specserve import LLM  # noqa: E402

PARITY_CONFIG = "chain3"


def make_engine(args: argparse.Namespace, name: str, dtype: str) -> tuple[LLM, dict[str, Any], float]:
    """``name``: a CONFIGS entry, or one with "+noearly" (no verify launched before the commit)."""
    base, _, opt = name.partition("+")
    if opt not in ("", "noearly", "nopresync"):
        raise SystemExit(f"unknown option +{opt} in {name!r} (noearly: no verify launched before the commit, "
                         "nopresync: a tree's next verify launched after the sync, not before it)")
    spec = dict(CONFIGS[base])
    if spec:
        spec.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=args.head,
                    speculative_policy="static")
    # a fixed KV size: engines built earlier in this process still hold GPU memory
    kw = dict(model=None if args.model == "default" else args.model, dtype=dtype, max_num_seqs=1, num_kv_blocks=args.num_kv_blocks, **spec)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    if opt == "noearly":
        llm.engine.drafter.pipeline.early_verify = False
    elif opt == "nopresync":
        llm.engine.drafter.pipeline.presync_verify = False
    return llm, kw, time.perf_counter() - t0


def graph_report(llm: LLM) -> dict[str, Any]:
    """Start-up CUDA-graph figures of one engine."""
    e = llm.engine
    g = e.runner.graphs
    out: dict[str, Any] = {
        "target_graphs": len(g.graphs) if g else 0,
        "target_token_counts": g.sizes if g else [],
        "target_capture_s": g.capture_seconds if g else None,
        "target_capture_mib": g.capture_bytes / 2**20 if g else None,
    }
    d = e.drafter
    if d is not None:
        cu, ch = d.catch_up.runner, d.proposer.chain_runner
        out.update({
            "catch_up_graphs": len(cu.graphs) if cu else 0,
            "catch_up_token_counts": cu.sizes if cu else [],
            "chain_graphs": sorted(ch.graphs) if ch and ch.graphs else [],
            "draft_capture_s": (cu.stats.seconds if cu else 0) + (ch.stats.seconds if ch else 0),
            "draft_capture_mib": d.graph_memory_bytes / 2**20,
        })
    return out


def path_counts(llm: LLM) -> Counter:
    e = llm.engine
    c = Counter(e.runner.path_counts)
    if e.drafter is not None:
        c.update(e.drafter.path_counts)
    return c


def fallbacks(name: str, delta: Counter, prompts: int) -> list[str]:
    """Eager forwards that should have been graph replays, in ``delta`` (counts over ``prompts`` runs)."""
    bad = []
    # each prompt's prefill may run eagerly (a long prompt); every decode/verify step must replay
    if delta["target:eager"] > prompts:
        bad.append(f"{name}: {delta['target:eager']} eager target forwards over {prompts} prompts")
    if delta["chain:eager"]:
        bad.append(f"{name}: {delta['chain:eager']} eager chain draft loops")
    if delta["tree:eager"]:
        bad.append(f"{name}: {delta['tree:eager']} eager tree expansions")
    if delta["fused_launch:eager"]:
        bad.append(f"{name}: {delta['fused_launch:eager']} fused launches run eagerly")
    # a prompt's first catch-up covers the whole prompt (eager Triton); the rest must replay
    if delta["catch_up:eager"] > prompts or delta["catch_up:torch"]:
        bad.append(f"{name}: catch-up eager {delta['catch_up:eager']}, torch {delta['catch_up:torch']} "
                   f"over {prompts} prompts")
    return bad


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer:
    """Synchronized wall time of a method, per call."""

    def __init__(self, obj: Any, name: str) -> None:
        self.times: list[float] = []
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            sync()
            self.times.append(time.perf_counter() - t0)
            return r

        setattr(obj, name, timed)
        self._undo = lambda: delattr(obj, name)

    def close(self) -> None:
        self._undo()


def breakdown(llm: LLM, prompt: list[int], output_len: int) -> dict[str, Any]:
    e = llm.engine
    timers = {}
    if e.drafter is not None:
        timers["verify"] = StepTimer(e.drafter, "verify_step")
        timers["draft"] = StepTimer(e.drafter, "draft_step")
    else:
        timers["forward_sample"] = StepTimer(e.runner, "execute")
    t0 = time.perf_counter()
    r = run_one(llm, prompt, output_len)
    wall = time.perf_counter() - t0
    for t in timers.values():
        t.close()
    steps = r["engine_steps"]
    out: dict[str, Any] = {"engine_steps": steps, "wall_ms_per_step": 1000 * wall / steps,
                           "accept_length": r["accept_length"]}
    for k, t in timers.items():
        decode = t.times[1:]  # the first call is the prefill step
        out[f"{k}_ms_median"] = 1000 * median(decode) if decode else None
        out[f"{k}_ms_mean"] = 1000 * sum(decode) / len(decode) if decode else None
    out["decode_wall_ms_per_step"] = r["decode_ms_per_step"]
    timed = sum(out[f"{k}_ms_mean"] or 0 for k in timers)
    # scheduler, commit, detokenize, python (decode steps; the timers' own syncs land here too)
    out["other_ms_per_step"] = r["decode_ms_per_step"] - timed if r["decode_ms_per_step"] else None
    return out


def parity(args: argparse.Namespace, prompts: list[list[int]], dtype: str,
           engines: dict[str, LLM] | None = None) -> dict[str, Any]:
    got = {}
    cfg = args.parity_config
    for name in ("nospec", cfg):
        llm = engines[name] if engines else make_engine(args, name, dtype)[0]
        before = path_counts(llm)
        got[name] = [run_one(llm, p, args.parity_len)["token_ids"] for p in prompts]
        got[name + "_paths"] = path_counts(llm) - before
        if not engines:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    ref, out = got["nospec"], got[cfg]
    diverged = []
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diverged.append({"prompt": i, "first_divergence": pos, "nospec": a[pos : pos + 4],
                             "spec": b[pos : pos + 4]})
    return {"dtype": dtype, "config": cfg, "prompts": len(prompts), "tokens_each": args.parity_len,
            "equal": len(prompts) - len(diverged), "agreement": (len(prompts) - len(diverged)) / len(prompts),
            "diverged": diverged,
            "fallbacks": fallbacks(f"parity {dtype} {cfg}", got[cfg + "_paths"], len(prompts))
            + fallbacks(f"parity {dtype} nospec", got["nospec_paths"], len(prompts))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="SmolLM2 GGUF")
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--output-file", required=True)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--parity-prompts", type=int, default=50)
    ap.add_argument("--parity-len", type=int, default=128)
    ap.add_argument("--max-prompt-chars", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--natural-stops", action="store_true",
                    help="timed requests stop at the model's end of turn (at most --output-len tokens)")
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--configs", default="nospec,chain3,chain5,tree")
    ap.add_argument("--skip-fp32-parity", action="store_true")
    ap.add_argument("--parity-config", default=PARITY_CONFIG,
                    help="the speculative configuration whose greedy outputs are compared with no-spec's "
                         "(one of --configs)")
    ap.add_argument("--allow-cpu", action="store_true", help="dry run of this script on the CPU (no graphs: fails)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu_spec_c1 needs a CUDA device")
    names = args.configs.split(",")
    if names[0] != "nospec" or args.parity_config not in names:
        raise SystemExit(f"--configs must start with nospec and include {args.parity_config} (--parity-config)")
    t_start = time.perf_counter()
    result: dict[str, Any] = run_metadata()
    result["command"] = "python " + " ".join(["benchmarks/gpu_spec_c1.py"] + (argv if argv is not None else sys.argv[1:]))
    result["benchmark"] = "gpu_spec_c1"
    result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result["draft_head"] = {"path": args.head, **head_provenance(args.head)}
    result["settings"] = {k: getattr(args, k) for k in ("num_prompts", "output_len", "parity_prompts", "parity_len",
                                                         "max_prompt_chars", "seed", "num_kv_blocks",
                                                         "natural_stops", "parity_config")}
    result["settings"].update(greedy=True, concurrency=1, dtype="bfloat16", policy="static", configs=names)

    engines: dict[str, LLM] = {}
    result["engines"] = {}
    for name in names:
        llm, kw, secs = make_engine(args, name, "bfloat16")
        engines[name] = llm
        result["engines"][name] = {"args": kw, "load_s": secs, **graph_report(llm)}
        print(f"{name}: ready in {secs:.1f}s {result['engines'][name]}", flush=True)

    tok = engines["nospec"].tokenizer
    all_prompts = chat_prompt_ids(tok, max(args.num_prompts + 2, args.parity_prompts), seed=args.seed,
                                  max_chars=args.max_prompt_chars)
    warm, timed_prompts, probe = all_prompts[0], all_prompts[1 : args.num_prompts + 1], all_prompts[args.num_prompts + 1]
    for llm in engines.values():
        run_one(llm, warm, 16)
    start_paths = {n: path_counts(llm) for n, llm in engines.items()}

    # 1. throughput
    runs: list[dict[str, Any]] = []
    for i, p in enumerate(timed_prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        got = {n: run_one(engines[n], p, args.output_len, args.natural_stops) for n in order}
        ref = got["nospec"]["token_ids"]
        for n in order:
            r = got[n]
            runs.append({"prompt_index": i, "config": n, "order": order.index(n), "same_tokens_as_nospec": r["token_ids"] == ref,
                         **{k: v for k, v in r.items() if k != "token_ids"}})
        print(f"prompt {i} ({len(p)} tok): " + " | ".join(
            f"{n} {got[n]['tok_s']:.0f} tok/s" + (f" al {got[n]['accept_length']:.2f}" if got[n]["accept_length"] else "")
            for n in names), flush=True)
    result["runs"] = runs
    summary = []
    problems: list[str] = []
    for n in names:
        rs = [r for r in runs if r["config"] == n]
        tokens = sum(r["output_tokens"] for r in rs)
        secs = sum(r["total_s"] for r in rs)
        delta = path_counts(engines[n]) - start_paths[n]
        bad = fallbacks(n, delta, len(rs))
        problems += bad
        summary.append({
            "config": n, **CONFIGS[n.partition("+")[0]], "tok_s": tokens / secs, "tok_s_median": median([r["tok_s"] for r in rs]),
            "decode_tok_s_median": median([r["decode_tok_s"] for r in rs]),
            "decode_ms_per_step_median": median([r["decode_ms_per_step"] for r in rs]),
            "accept_length_median": median([r["accept_length"] for r in rs]),
            "same_tokens_as_nospec": f"{sum(r['same_tokens_as_nospec'] for r in rs)}/{len(rs)}",
            "paths": dict(delta), "fallbacks": bad,
        })
    base = summary[0]["tok_s"]
    for s in summary:
        s["speedup_vs_nospec"] = s["tok_s"] / base
        print(f"{s['config']}: {s['tok_s']:.0f} tok/s x{s['speedup_vs_nospec']:.2f} "
              f"(accept length {s['accept_length_median']}, {s['decode_ms_per_step_median']:.2f} ms/step) "
              f"paths {s['paths']}", flush=True)
    result["summary"] = summary
    result["goal_c1_speedup_2.5x"] = {"best": max(s["speedup_vs_nospec"] for s in summary[1:]),
                                      "met": max(s["speedup_vs_nospec"] for s in summary[1:]) >= 2.5}

    # 2. step breakdown (synchronized timers)
    result["breakdown"] = {n: breakdown(engines[n], probe, args.output_len) for n in names}
    for n, b in result["breakdown"].items():
        print(f"breakdown {n}: {b}", flush=True)

    # 3. greedy parity: bf16 with the engines above, fp32 with new ones
    par_prompts = all_prompts[: args.parity_prompts]
    result["parity"] = {"bf16": parity(args, par_prompts, "bfloat16", engines)}
    print(f"parity bf16: {result['parity']['bf16']['equal']}/{len(par_prompts)}", flush=True)
    engines.clear()
    gc.collect()  # engines and their drafters reference each other
    torch.cuda.empty_cache()
    if not args.skip_fp32_parity:
        result["parity"]["fp32"] = parity(args, par_prompts, "float32")
        print(f"parity fp32: {result['parity']['fp32']['equal']}/{len(par_prompts)}", flush=True)
    for p in result["parity"].values():
        problems += p["fallbacks"]
    result["fallbacks"] = problems
    result["wall_s"] = time.perf_counter() - t_start
    write_json(args.output_file, result)
    if problems:
        print("FALLBACKS TO EAGER (the figures above are not the graph path):\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
