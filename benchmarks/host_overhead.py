"""What an engine's Python costs per step at high concurrency, spec engine against no-spec.

Issue #8: on the GPU a step at 256 requests is mostly host time, and a speculative engine that decodes
plainly (threshold 0, or adaptive at k = 0) ran at 0.88-0.96x of a no-spec engine. Here the model is tiny
(random weights, 2 layers, hidden 32, a 2,048-word vocabulary) so that on the CPU a step is almost all
engine code: the same closed loop through each engine, then again under cProfile for the functions with
the most own time, and the garbage collector's time per step (the engines are frozen out of its reach once
warm, as the server freezes its engine; ``--no-gc-freeze`` leaves them in it).

    python benchmarks/host_overhead.py --concurrency 256 --output-file benchmarks/results/host_overhead.json
    python benchmarks/host_overhead.py --device cuda --concurrency 16 --configs nospec,spec_off --torch-profile ...
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import tempfile
import time
import types
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import run_metadata, write_json  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from tiny_model import make_dummy_model_dir, make_random_head, make_tiny_model  # noqa: E402

from specserve import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from specserve.engine.heap import freeze_startup_heap  # noqa: E402
from specserve.loader import load_model_source  # noqa: E402

VOCAB, LAYERS = 2048, 2  # a tiny random Llama (tests/tiny_model.py: hidden 32) and a random EAGLE-3 head
CONFIGS: dict[str, dict[str, Any]] = {
    "nospec": {},
    # a second plain engine: how far two identical engines in one process differ (the noise floor)
    "nospec_b": {},
    # plain decoding step by step / overlap scheduled (--overlap-schedule; "nospec" is auto: on for CUDA)
    "nospec_sync": {"overlap_schedule": "off"},
    "nospec_overlap": {"overlap_schedule": "on"},
    # the head loaded, speculation never on: what plain decoding costs in a spec engine
    "spec_off": {"speculative_policy": "threshold", "speculative_disable_batch_threshold": 0},
    # adaptive, held at plain decoding (its quick decisions), features kept for a later catch-up
    "adaptive_at_0": {"speculative_policy": "adaptive", "speculative_calibrate": False},
    "static_chain1": {"speculative_policy": "static", "speculative_num_steps": 1},
    # adaptive with every decision forced to plain decoding: its plain path without explorations
    "adaptive_forced0": {"speculative_policy": "adaptive", "speculative_calibrate": False, "forced_arm": 0},
    # the same two step by step / overlap scheduled (auto: overlapped on CUDA only)
    # the same, its features scattered after each forward (before session 44) instead of written by it
    "spec_off_scattered": {"speculative_policy": "threshold", "speculative_disable_batch_threshold": 0,
                           "features_scattered": True},
    "spec_off_sync": {"speculative_policy": "threshold", "speculative_disable_batch_threshold": 0,
                      "overlap_schedule": "off"},
    "spec_off_overlap": {"speculative_policy": "threshold", "speculative_disable_batch_threshold": 0,
                         "overlap_schedule": "on"},
    "adaptive_at_0_overlap": {"speculative_policy": "adaptive", "speculative_calibrate": False, "overlap_schedule": "on"},
    "adaptive_forced0_overlap": {"speculative_policy": "adaptive", "speculative_calibrate": False, "forced_arm": 0,
                                 "overlap_schedule": "on"},
    # a drafting depth, fixed (static) against the adaptive engine held at it: the adaptive policy's own cost
    "static_chain3": {"speculative_policy": "static", "speculative_num_steps": 3},
    "adaptive_forced3": {"speculative_policy": "adaptive", "speculative_calibrate": False, "forced_arm": 3},
    "adaptive_forced1": {"speculative_policy": "adaptive", "speculative_calibrate": False, "forced_arm": 1},
    # one request's cycle on a GPU is host-bound: a chain and the default tree, fixed
    "static_chain5": {"speculative_policy": "static", "speculative_num_steps": 5},
    "static_tree": {"speculative_policy": "static", "speculative_num_steps": 5, "speculative_eagle_topk": 4,
                    "speculative_num_draft_tokens": 16},
    # adaptive as shipped (on the tiny model's random head it stays at plain decoding; on a real one it drafts)
    "adaptive": {"speculative_policy": "adaptive"},
    # up to 5 drafts, free and held at 5 (with --agree every draft is accepted, so the free one drafts 5 too)
    "adaptive5": {"speculative_policy": "adaptive", "speculative_num_steps": 5, "speculative_calibrate": False},
    "adaptive_forced5": {"speculative_policy": "adaptive", "speculative_num_steps": 5, "speculative_calibrate": False,
                         "forced_arm": 5},
}
DEFAULT_CONFIGS = "nospec,spec_off,adaptive_at_0,static_chain1"


class GCTimer:
    """Seconds spent in the garbage collector's collections, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, [0.0, 0.0, 0.0]
        return out

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


def serve(llm: LLM, prompts: list[list[int]], concurrency: int, lens: list[int],
          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> tuple[float, int]:
    """Closed loop: seconds and engine steps to serve every prompt (``lens``: its output tokens) with
    ``concurrency`` in flight."""
    eng = llm.engine
    queue = list(prompts)
    live: set[str] = set()
    steps = 0
    t0 = time.perf_counter()
    n = 0
    while queue or live:
        while queue and len(live) < concurrency:
            rid = f"h{n}"
            n += 1
            eng.add_request(rid, queue.pop(), SamplingParams(temperature=0.0, max_tokens=lens[len(queue)], ignore_eos=True,
                                                          output_kind=output_kind))
            live.add(rid)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        steps += 1
    return time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--model", default=None, help="a real model (GGUF or HF folder) with the shipped head; "
                    "default: the tiny random model and head")
    ap.add_argument("--dummy-smollm2", action="store_true",
                    help="SmolLM2-135M's shapes with random weights (--load-format dummy) and the shipped head: a "
                         "real step's device time where the GGUF is not at hand")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engines' max_num_seqs (default: --concurrency); the adaptive policy's start-up "
                         "profile times draft forwards up to it, and a catch-up's first estimate extrapolates that")
    ap.add_argument("--agree", action="store_true",
                    help="a tiny model and head that always agree (token 0): every draft is accepted, so an "
                         "adaptive engine drafts its deepest depth as a GPU one does at one request")
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="output lengths uniform in max-tokens x [1 - s, 1 + s] (0: all the same: waves)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per engine, interleaved")
    ap.add_argument("--top", type=int, default=25, help="functions listed per engine from cProfile")
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="cProfile's order")
    ap.add_argument("--filter", default="", help="a regular expression the listed functions' file:line(name) match "
                    "(e.g. 'specserve/': the engine's own, by cumulative time)")
    ap.add_argument("--time-calls", action="store_true",
                    help="one more pass per speculative engine with its bookkeeping calls timed one by one "
                         "(perf_counter around each: us per step and per call, without a profiler's slowdown)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also trace one more pass per engine with torch.profiler (device kernels too on CUDA): "
                         "ops and kernels per step, and where the engines' counts differ from the first one's")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the engines in reach of full garbage collections (the server freezes them)")
    ap.add_argument("--output-kind", default="cumulative", choices=[k.name.lower() for k in RequestOutputKind],
                    help="what each step's outputs hold (final_only: LLM.generate's; delta: a streaming client's)")
    ap.add_argument("--output-file", required=True)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    tmp = tempfile.mkdtemp(prefix="host_overhead_")
    head_dir: str | None = None  # the shipped head, for a real model
    load_format = "auto"
    if args.dummy_smollm2:
        model_dir, load_format = make_dummy_model_dir(os.path.join(tmp, "smollm2")), "dummy"
    elif args.model is None:
        model_dir = make_tiny_model(os.path.join(tmp, "model"), vocab=VOCAB, layers=LAYERS, constant=args.agree)
        head_dir = make_random_head(model_dir, os.path.join(tmp, "head"), constant=args.agree)
    else:
        model_dir = args.model
    vocab = load_model_source(model_dir).config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(L),), generator=g).tolist()
               for L in torch.randint(16, 128, (args.requests,), generator=g)]
    s_ = args.length_spread
    lens = [args.max_tokens] * args.requests if s_ <= 0 else [
        max(1, round(args.max_tokens * (1 - s_ + 2 * s_ * float(u)))) for u in torch.rand(args.requests, generator=g)]
    blocks_per_request = -(-(128 + max(lens) + 8) // 16) + 1  # prompt, output, drafts: no preemption
    dtype = "float32" if args.device == "cpu" else "auto"
    engines = {}
    for n in names:
        kw = dict(CONFIGS[n])
        forced = kw.pop("forced_arm", None)
        scattered = kw.pop("features_scattered", False)
        if any(k.startswith("speculative_") for k in kw):
            kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
        engines[n] = LLM(model_dir, device=args.device, dtype=dtype, max_num_seqs=args.max_num_seqs or args.concurrency,
                         num_kv_blocks=args.concurrency * blocks_per_request, max_num_batched_tokens=4096, load_format=load_format, **kw)
        if forced is not None:
            engines[n].engine.drafter.controller.forced_arm = forced
        if scattered:  # (its graphs are captured again at their next replay: what they write changed)
            engines[n].engine.drafter.target.set_feature_sink(None)
            engines[n].engine.drafter.features.in_forward = False
        serve(engines[n], prompts[:16], 8, [8] * 16)  # warm-up
    if not args.no_gc_freeze:
        freeze_startup_heap()
    kind = RequestOutputKind[args.output_kind.upper()]
    gc_timer = GCTimer()
    timing: dict[str, list[float]] = {n: [] for n in names}
    seconds: dict[str, list[float]] = {n: [] for n in names}
    gc_ms: dict[str, list[list[float]]] = {n: [] for n in names}
    steps_of: dict[str, int] = {}
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            gc_timer.take()
            s, steps = serve_as(n)(engines[n], prompts, args.concurrency, lens, kind)
            timing[n].append(1000 * s / steps)
            seconds[n].append(s)
            gc_ms[n].append([round(1000 * x / steps, 3) for x in gc_timer.take()])
            steps_of[n] = steps
    gc_timer.close()  # (main() also runs inside the test process)
    result: dict[str, Any] = {"benchmark": "host_overhead", **run_metadata(),
                              "command": "python benchmarks/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "model": ({"vocab": VOCAB, "layers": LAYERS, "made_by": "tests/tiny_model.py", "agree": args.agree}
                                                  if args.model is None and not args.dummy_smollm2
                                        else {"path": args.model or "SmolLM2-135M shapes, random weights", "head": "shipped"}),
                              "settings": vars(args), "configs": {}}
    base = min(timing[names[0]])
    own: dict[str, dict[str, tuple[float, float]]] = {}  # per engine: function -> (own us, calls) per step
    for n in names:
        prof = cProfile.Profile()
        prof.enable()
        _, prof_steps = serve(engines[n], prompts, args.concurrency, lens, kind)
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        own[n] = own_time_per_step(st, prof_steps)
        st.sort_stats(args.sort).print_stats(*([args.filter] if args.filter else []), args.top)
        ms = min(timing[n])
        result["configs"][n] = {"ms_per_step": round(ms, 3), "ms_per_step_rounds": [round(x, 3) for x in timing[n]],
                                "over_first": round(ms / base, 3), "engine_steps": steps_of[n],
                                "tok_s_rounds": [round(sum(lens) / x, 1) for x in seconds[n]],
                                "tok_s_over_first": round(min(seconds[names[0]]) / min(seconds[n]), 3),
                                "gc_ms_per_step_rounds": gc_ms[n], **decisions_of(engines[n]),
                                "profile_top": [ln for ln in buf.getvalue().splitlines() if ln.strip()][:args.top + 8]}
        print(f"{n}: {ms:.2f} ms/step ({ms / base:.3f}x {names[0]}), {steps_of[n]} steps, tok/s "
              f"{result['configs'][n]['tok_s_over_first']:.3f}x {names[0]}; k {result['configs'][n].get('k_histogram')}; "
              f"collector ms/step per round (gen 0, 1, 2): {gc_ms[n]}", flush=True)
    if args.time_calls:
        for n in names:
            if engines[n].engine.drafter is not None:
                timed = time_calls(engines[n], prompts, args.concurrency, lens, kind)
                result["configs"][n]["calls_per_step"] = timed
                print(f"{n}: us per step (calls per step) " + ", ".join(
                    f"{f} {v['us_per_step']} ({v['calls_per_step']})" for f, v in timed.items()), flush=True)
    result["profile_differing"] = differing_functions(own, names[0], args.top)
    for n, rows in result["profile_differing"].items():
        print(f"cProfile, {n} against {names[0]} (own us / calls per step, under the profiler):", flush=True)
        for r in rows[:12]:
            print(f"  {r['function'][:90]:90s} {r['own_us']:+8.1f} {r['calls']:+7.2f}")
    if args.torch_profile:
        traced = {n: torch_ops_per_step(engines[n], prompts, args.concurrency, lens, args.device) for n in names}
        for n in names:
            result["configs"][n]["torch_ops_per_step"] = traced[n]
        result["torch_ops_differing"] = differing_ops(traced, names[0], args.top)
        for n, rows in result["torch_ops_differing"].items():
            print(f"torch.profiler, {n} against {names[0]} (calls / self CPU us / device us per step):", flush=True)
            for r in rows:
                print(f"  {r['name'][:70]:70s} {r['calls']:+7.2f} {r['cpu_us']:+8.1f} {r['device_us']:+8.1f}")
    write_json(args.output_file, result)
    return result


def serve_as(name: str) -> Callable[..., tuple[float, int]]:
    """``serve`` under the name ``timed[<name>]``: a sampling profiler run over this script (py-spy
    record --idle -f raw, then benchmarks/pyspy_diff.py) then tells each engine's timed rounds apart."""
    fn = types.FunctionType(serve.__code__.replace(co_name=f"timed[{name}]", co_qualname=f"timed[{name}]"),
                            serve.__globals__, f"timed[{name}]", serve.__defaults__)
    return fn


def decisions_of(llm: LLM) -> dict[str, Any]:
    """A speculative engine's decisions over every pass (warm-up and profile included): k per
    request-step, explorations, decisions, accepted drafts per verified request and per draft."""
    d = llm.engine.drafter
    if d is None:
        return {}
    ctl, st = d.controller, llm.engine.stats
    return {"k_histogram": {int(k): v for k, v in sorted(ctl.k_histogram.items())}, "decisions": ctl.decisions,
            "explorations": ctl.explorations,
            "accepted_per_verify": round(st.spec_accepted_tokens / st.spec_verify_steps, 3) if st.spec_verify_steps else None,
            "accepted_share": round(st.spec_accepted_tokens / st.spec_draft_tokens, 4) if st.spec_draft_tokens else None}


# a speculative engine's per-step bookkeeping, by where it lives (``time_calls``)
TIMED_CALLS = {"drafter": ("draft_step", "verify_step", "plain_step"),
               "controller": ("quick_arm", "count_off", "decide", "_decide_adaptive", "flush", "_finish_cycle",
                              "_observe_step", "_reference_step"),
               "bandit": ("observe",), "cost": ("observe_step",)}


def time_calls(llm: LLM, prompts: list[list[int]], concurrency: int, lens: list[int],
               kind: RequestOutputKind) -> dict[str, dict[str, float]]:
    """Microseconds per engine step, calls per step and microseconds per call of the functions in
    TIMED_CALLS, over one closed-loop pass with each wrapped in a perf_counter pair (~0.2 us a call: the
    profilers slow every Python call, which overstates code that makes many small ones). Times nest
    (decide holds _decide_adaptive; flush holds the deferred bookkeeping it runs)."""
    d = llm.engine.drafter
    ctl = d.controller
    owners = {"drafter": d, "controller": ctl, "bandit": ctl.bandit, "cost": ctl.cost}
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        spent[label], calls[label] = 0.0, 0

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(obj, name, timed)

    for owner, funcs in TIMED_CALLS.items():
        for f in funcs:
            wrap(owners[owner], f, f"{owner}.{f}")
    try:
        _, steps = serve(llm, prompts, concurrency, lens, kind)
    finally:
        for owner, funcs in TIMED_CALLS.items():
            for f in funcs:
                delattr(owners[owner], f)  # (the instance attribute: the class's method again)
    return {k: {"us_per_step": round(1e6 * spent[k] / steps, 2), "calls_per_step": round(calls[k] / steps, 3),
                "us_per_call": round(1e6 * spent[k] / calls[k], 2) if calls[k] else None} for k in spent}


def own_time_per_step(st: pstats.Stats, steps: int) -> dict[str, tuple[float, float]]:
    """Per function (file:line(name)): its own time in microseconds and its calls, per engine step."""
    out = {}
    for (path, line, fn), (_, ncalls, tottime, _, _) in st.stats.items():  # type: ignore[attr-defined]
        out[f"{os.path.basename(path)}:{line}({fn})"] = (1e6 * tottime / steps, ncalls / steps)
    return out


def differing_functions(own: dict[str, dict[str, tuple[float, float]]], first: str, top: int) -> dict[str, list[dict]]:
    """Per engine after the first: the functions whose own time per step exceeds the first engine's the
    most (what the engine adds on the host), as differences; with the sum of every difference first."""
    out: dict[str, list[dict]] = {}
    for n, funcs in own.items():
        if n == first:
            continue
        base = own[first]
        rows = [{"function": f, "own_us": round(funcs.get(f, (0.0, 0.0))[0] - base.get(f, (0.0, 0.0))[0], 2),
                 "calls": round(funcs.get(f, (0.0, 0.0))[1] - base.get(f, (0.0, 0.0))[1], 2)}
                for f in set(funcs) | set(base)]
        total = round(sum(r["own_us"] for r in rows), 1)
        rows.sort(key=lambda r: r["own_us"], reverse=True)
        out[n] = [{"function": "(every function)", "own_us": total, "calls": 0.0}] + rows[:top]
    return out


def torch_ops_per_step(llm: LLM, prompts: list[list[int]], concurrency: int, lens: list[int],
                       device: str) -> dict[str, dict[str, float]]:
    """Per op or kernel name (torch.profiler's key averages over one closed-loop pass): calls, self CPU
    microseconds and self device microseconds, per engine step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        _, steps = serve(llm, prompts, concurrency, lens)
        if device == "cuda":
            torch.cuda.synchronize()
    out: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:  # older torch
            dev = getattr(e, "self_cuda_time_total", 0.0)
        out[e.key] = {"calls": round(e.count / steps, 3), "cpu_us": round(e.self_cpu_time_total / steps, 2),
                      "device_us": round(dev / steps, 2)}
    return out


def differing_ops(traced: dict[str, dict[str, dict[str, float]]], first: str, top: int) -> dict[str, list[dict]]:
    """Per engine after the first: the ops whose calls per step differ most from the first engine's (then
    self CPU time), as differences."""
    out: dict[str, list[dict]] = {}
    zero = {"calls": 0.0, "cpu_us": 0.0, "device_us": 0.0}
    for n, ops in traced.items():
        if n == first:
            continue
        rows = []
        for name in set(ops) | set(traced[first]):
            a, b = ops.get(name, zero), traced[first].get(name, zero)
            rows.append({"name": name, **{k: round(a[k] - b[k], 2) for k in zero}})
        rows.sort(key=lambda r: (abs(r["calls"]) >= 0.5, abs(r["cpu_us"])), reverse=True)
        out[n] = rows[:top]
    return out


if __name__ == "__main__":
    main()
