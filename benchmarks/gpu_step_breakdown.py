"""Where an engine step's time goes, per phase, for plain decoding, a static chain and adaptive.

Issue #8: at high concurrency on the GPU a step is mostly host time. This times the phases of
``LLMEngine.step`` (schedule, forward + verify, commit, draft_step, building outputs) and, inside
the drafter, the draft loop and its catch-ups, by wrapping those methods on one engine per
configuration, then serves the same closed-loop batch as ``gpu_adaptive.py`` through each.
With ``--sync`` every phase ends with a device synchronize, so GPU work is charged to the phase
that launched it (slower overall; without it, asynchronous work lands where the host waits).

    python benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --output-file $OUT/gpu_step_breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chat_prompt_ids, run_metadata, write_json  # noqa: E402
from cycle_log import CycleLog  # noqa: E402
from gpu_adaptive import engine_args, output_lens, run_batch  # noqa: E402
from gpu_spec_c1 import path_counts  # noqa: E402
from spec_single import DEFAULT_HEAD  # noqa: E402

from specserve import LLM  # noqa: E402
from specserve.engine.heap import freeze_startup_heap  # noqa: E402


Wrapped = list[tuple[Any, str]]  # (object, method name) replaced on the instance, to undo afterwards


def wrap(obj: Any, name: str, label: str, acc: dict[str, list[float]], sync: bool, wrapped: Wrapped) -> None:
    """Replace obj.name by a version that adds its wall time (ms) to acc[label]."""
    fn: Callable = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        acc[label].append(1000 * (time.perf_counter() - t0))
        return out

    setattr(obj, name, timed)
    wrapped.append((obj, name))


def instrument(llm: LLM, sync: bool) -> tuple[dict[str, list[float]], Wrapped]:
    """Time the engine's phases; returns the times and what to unwrap (``unwrap``) afterwards."""
    eng = llm.engine
    acc: dict[str, list[float]] = collections.defaultdict(list)
    wrapped: Wrapped = []
    wrap(eng, "step", "step", acc, sync, wrapped)
    wrap(eng.scheduler, "schedule", "schedule", acc, sync, wrapped)
    wrap(eng.scheduler, "commit", "commit", acc, sync, wrapped)
    wrap(eng, "_output", "output (per request)", acc, sync, wrapped)
    if eng.drafter is not None:
        d = eng.drafter
        wrap(d, "verify_step", "forward + verify", acc, sync, wrapped)
        wrap(d, "draft_step", "draft_step", acc, sync, wrapped)
        wrap(d, "_draft", "draft loop (in draft_step)", acc, sync, wrapped)
        wrap(d, "_catch_up", "catch-up (in draft loop)", acc, sync, wrapped)
        wrap(d, "_catch_up_finished", "finished requests' catch-up (in draft_step)", acc, sync, wrapped)
        wrap(d.controller, "decide", "decide (in draft_step)", acc, sync, wrapped)
        wrap(d, "_record", "record (in forward + verify)", acc, sync, wrapped)
        wrap(d, "_draft_chain_static", "chain loop (in draft loop)", acc, sync, wrapped)
        # inside forward + verify: the fused launch (the next catch-up and chain, before the sync), the
        # read-back around it (its launch, the copy, the wait), the early launch of the next verify
        wrap(d, "_read_back_around", "read-back + fused launch (in verify)", acc, sync, wrapped)
        wrap(d, "_launch_fused", "fused launch (in read-back)", acc, sync, wrapped)
        wrap(d, "_launch_early_verify", "early verify launch (in verify)", acc, sync, wrapped)
        wrap(d, "_verify_all", "acceptance (in verify)", acc, sync, wrapped)
        wrap(d, "_early_matches", "early plan check (in verify)", acc, sync, wrapped)
        if d.catch_up.runner is not None:
            wrap(d.catch_up.runner, "run", "catch-up runner", acc, sync, wrapped)
        if d.proposer.chain_runner is not None:
            wrap(d.proposer.chain_runner, "run", "chain runner", acc, sync, wrapped)
        wrap(d.target, "compute_logits", "target.compute_logits", acc, sync, wrapped)
        for name in ("quick_arm", "uniform", "count_off", "finish_cycle", "observe_many", "observe_step", "flush"):
            wrap(d.controller, name, f"controller.{name}", acc, sync, wrapped)
    else:
        # (overlap scheduled, the engine launches steps itself: timed with a sync, they no longer overlap)
        wrap(eng.runner, "launch" if eng.overlap else "execute", "forward + sample", acc, sync, wrapped)
    # the runner's parts, in both kinds of engine (inside the phases above)
    wrap(eng.runner, "prepare", "runner.prepare", acc, sync, wrapped)
    wrap(eng.runner, "forward", "runner.forward", acc, sync, wrapped)
    wrap(eng.runner, "launch_sampling", "runner.sample", acc, sync, wrapped)
    return acc, wrapped


def unwrap(wrapped: Wrapped) -> None:
    for obj, name in reversed(wrapped):
        delattr(obj, name)


def profile_run(llm: LLM, batch: list[list[int]], c: int, output_len: int | list[int]) -> dict[str, Any]:
    """The batch again under torch.profiler (device kernel time per engine step: what the GPU was
    busy with; the rest of a step is host time the GPU waited for) and cProfile (host functions)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    # cProfile first, before torch.profiler has attached to the device: under the trace a graph launch
    # of ~310 kernels held the host ~220 us against ~9 us without (results/gpu_session25/), and a
    # configuration timed after another's trace once ran 30 % slow (cause not isolated)
    pr = cProfile.Profile()
    pr.enable()
    got2 = run_batch(llm, batch, c, output_len)
    pr.disable()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        got = run_batch(llm, batch, c, output_len)
    steps = max(got["engine_steps"], 1)
    kernels = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA")]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(40)
    cum = io.StringIO()  # where the engine's own functions spend it, callees included
    pstats.Stats(pr, stream=cum).sort_stats("cumulative").print_stats("specserve", 60)
    return {"ms_per_step_profiled": got["ms_per_step"], "gpu_kernel_ms_per_step": round(kernel_us / 1e3 / steps, 3),
            "kernels_by_device_time": [{"name": e.key[:80], "calls_per_step": round(e.count / steps, 2),
                                        "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 4)} for e in top],
            "cprofile_steps": got2["engine_steps"], "cprofile_top": out.getvalue().splitlines()[:55],
            "cprofile_cumulative": cum.getvalue().splitlines()[:70]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="SmolLM2 GGUF ('default' for the packaged one)")
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--output-file", required=True)
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--configs", default="nospec,static_chain1,adaptive",
                    help="names from gpu_adaptive.SPEC; NAME@K holds that engine's controller at depth K")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.5,
                    help="output lengths uniform over mean x [1 - s, 1 + s] (0: all equal, requests run in waves)")
    ap.add_argument("--requests-per-c", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="synchronize the device after every timed phase")
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--allow-cpu", action="store_true", help="dry run on the CPU")
    ap.add_argument("--profile", action="store_true",
                    help="run each point once more under torch.profiler and cProfile: GPU busy time per step "
                         "(sum of kernel times) and the host functions with the most own time")
    ap.add_argument("--log-cycles", action="store_true",
                    help="keep every cycle an adaptive engine's bandit measured, beside the engine's own time (cycle_log.py)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu_step_breakdown needs a CUDA device")
    cs = [int(c) for c in args.concurrency.split(",")]
    names = args.configs.split(",")
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {"benchmark": "gpu_step_breakdown", **run_metadata(),
                              "command": "python " + " ".join(["benchmarks/gpu_step_breakdown.py"] + (argv if argv is not None else sys.argv[1:])),
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "settings": vars(args), "points": []}
    engines: dict[str, LLM] = {}
    for n in names:
        # "adaptive@5": the adaptive engine held at depth 5 (no decisions); "...+nofinish": finishing
        # requests are never caught up (their blocks keep no draft KV); "...+nofull": the adaptive
        # controller's full decisions are taken after the verify's sync (fuse_full off); "...+noearly":
        # no verify is launched before the commit (early_verify off); "...+nograph": the fused launch
        # step by step, not as one graph (fused_launch_graph off)
        spec, _, opt = n.partition("+")
        base, _, forced = spec.partition("@")
        engines[n] = LLM(**engine_args(base, args.model, args.head, max(cs), args.num_kv_blocks))
        if forced:
            engines[n].engine.drafter.controller.forced_arm = int(forced)
        if opt == "nofinish":
            engines[n].engine.scheduler.on_finish = None
        elif opt == "nofull":
            engines[n].engine.drafter.controller.fuse_full = False
        elif opt == "noearly":
            engines[n].engine.drafter.controller.early_verify = False
        elif opt == "nograph":
            engines[n].engine.drafter.controller.fused_launch_graph = False
        elif opt:
            raise SystemExit(f"unknown option +{opt} (nofinish, nofull, noearly, nograph)")
    need = max(args.requests_per_c * c for c in cs)
    prompts = chat_prompt_ids(engines[names[0]].tokenizer, min(need, 592) + 8, seed=0)
    warm, prompts = prompts[-8:], prompts[:-8]
    for llm in engines.values():
        run_batch(llm, warm, 8, 16)
    result["gc_frozen_objects"] = freeze_startup_heap()  # as the server does once its engine is built
    def batch_of(c: int) -> tuple[list[list[int]], list[int]]:  # a point's prompts and output lengths
        batch = [prompts[i % len(prompts)] for i in range(args.requests_per_c * c)]
        return batch, output_lens(len(batch), args.output_len, args.length_spread)

    for c in cs:
        batch, lens = batch_of(c)
        point: dict[str, Any] = {"concurrency": c, "configs": {}}
        for n in names:
            paths_before = path_counts(engines[n])
            acc, wrapped = instrument(engines[n], args.sync)
            logged = CycleLog.start(engines[n]) if args.log_cycles else None
            got = run_batch(engines[n], batch, c, lens)
            if logged is not None:
                logged.detach()
            steps = len(acc["step"])
            phases = {k: {"calls": len(v), "ms_total": round(sum(v), 1),
                          "ms_per_step": round(sum(v) / steps, 3)} for k, v in acc.items()}
            unwrap(wrapped)
            d = engines[n].engine.drafter
            bm = engines[n].engine.blocks.stats
            extra = {"prefix_hits": bm.prefix_hits, "prefix_refused": bm.prefix_refused,  # engine totals so far
                     "finish_catch_ups": d.finish.requests,
                     "finish_catch_up_tokens": d.finish.tokens}
            point["configs"][n] = {**extra, "tok_s": got["tok_s"], "steady_tok_s": got["steady_tok_s"],
                                   "steady_s": got["steady_s"], "engine_steps": got["engine_steps"],
                                   "ms_per_step": got["ms_per_step"], "k_histogram": got["k_histogram"],
                                   "phases": phases,
                                   "path_counts": dict(path_counts(engines[n]) - paths_before)}
            if logged is not None:
                point["configs"][n].update(cycle_summary=logged.summary(), **logged.logs())
                point["configs"][n]["controller"] = engines[n].engine.drafter.controller.snapshot()
            print(f"  paths: {point['configs'][n]['path_counts']}", flush=True)
            print(f"C={c} {n}: {got['tok_s']:.0f} tok/s (steady {got['steady_tok_s'] or 0:.0f}), {got['ms_per_step']:.2f} ms/step, {extra} | " + ", ".join(
                f"{k} {v['ms_per_step']:.2f}" for k, v in phases.items()), flush=True)
        result["points"].append(point)
        write_json(args.output_file, result)  # (each point as it ends: a run cut short keeps what it has)
    if args.profile:
        # after every timed run: once torch.profiler has attached to the device, CUDA calls stay slower
        # for the rest of the process (session 43 on an H100: a spec engine timed after no-spec's trace
        # ran 2.13 ms a step, 1.60 in a run without --profile; graph launches ~210 us against ~40)
        for point, c in zip(result["points"], cs):
            batch, lens = batch_of(c)
            for n in names:
                point["configs"][n]["profile"] = profile_run(engines[n], batch, c, lens)
                print(f"C={c} {n}: profiled, {point['configs'][n]['profile']['gpu_kernel_ms_per_step']} ms of kernels "
                      "a step", flush=True)
            write_json(args.output_file, result)
    return result


if __name__ == "__main__":
    main()
