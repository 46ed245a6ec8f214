"""Decode speed of specserve vs transformers eager ``generate`` on SmolLM2-135M-Instruct (fp32, CPU).

Both run in this one process on the same ShareGPT chat prompts (token ids from specserve's
tokenizer, fed to both), greedy, exactly ``--output-len`` new tokens (specserve: ignore_eos;
transformers: no EOS in its generation config, which is the same rule: EOS may be generated and
does not stop). Greedy outputs are compared as a sanity check.
Configurations are interleaved (specserve and transformers alternate which goes first) and
repeated; every repeat of a batch size uses its own disjoint prompt set, the same for both.

Decode is timed apart from prefill: a timestamp after every engine step (specserve) and at every
logits-processor call (transformers, i.e. once per generated token). Decode time runs from the
moment every request holds its first token to the last token; decode tok/s = tokens generated in
that span / its length. The engine gets a token budget that fits the whole batch's prompts, so
step 1 is the prefill and every later step is a pure decode step at the full batch size.

Also measured: load time (cold GGUF conversion into an empty SPECSERVE_CACHE_DIR, then cached),
transformers' GGUF load time, the bare linear-layer time of one batch-1 token (a measured floor),
and a profile of batch-1 decode steps (engine phases + torch.profiler op table).

    python benchmarks/decode.py --output-file benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from specserve import LLM, SamplingParams
from specserve.bench.harness import OtherCpu, chat_prompt_ids, load_average, median, run_metadata, wait_for_quiet, write_json
from specserve.loader import default_model_path

_ids = itertools.count()


# -- specserve ----------------------------------------------------------------------------------

def run_specserve(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = []
    for p in prompts:
        rid = f"decode-bench-{next(_ids)}"
        eng.add_request(rid, p, sp)
        reqs.append(eng.requests[rid])
    times: list[float] = []
    totals: list[int] = []
    mins: list[int] = []
    while eng.has_unfinished_requests():
        eng.step()
        times.append(time.perf_counter())
        counts = [r.num_output_tokens for r in reqs]
        totals.append(sum(counts))
        mins.append(min(counts))
    outputs = [list(r.output_token_ids) for r in reqs]
    return _summarise(t0, times, totals, mins, outputs)


def _summarise(t0: float, times: list[float], totals: list[int], mins: list[int],
               outputs: list[list[int]]) -> dict[str, Any]:
    """Split a run at the first moment every request holds a token: prefill before, decode after."""
    f = next(i for i, m in enumerate(mins) if m >= 1)
    dec_tokens = totals[-1] - totals[f]
    dec_time = times[-1] - times[f]
    steps = [b - a for a, b in zip(times[f:], times[f + 1 :])]
    return {
        "prefill_s": times[f] - t0,
        "prefill_steps": f + 1,
        "decode_s": dec_time,
        "decode_tokens": dec_tokens,
        "decode_tok_s": dec_tokens / dec_time if dec_time > 0 else None,
        "decode_steps": len(steps),
        "ms_per_step_mean": 1000 * dec_time / len(steps) if steps else None,
        "ms_per_step_median": 1000 * statistics.median(steps) if steps else None,
        "total_s": times[-1] - t0,
        "outputs": outputs,
    }


# -- transformers -------------------------------------------------------------------------------

def load_transformers(path: str) -> tuple[Any, float]:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    dt = time.perf_counter() - t
    # like specserve's ignore_eos: EOS may be generated and does not stop. (min_new_tokens would
    # instead forbid EOS, and the outputs would part ways wherever the model wants to end.)
    model.generation_config.eos_token_id = None
    return model, dt


def run_transformers(model: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> dict[str, Any]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, right after that token's forward."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([clock]))
    n = len(clock.times)
    b = len(prompts)
    return _summarise(t0, clock.times, [b * (i + 1) for i in range(n)], [i + 1 for i in range(n)],
                      out[:, width:].tolist())


# -- load time ----------------------------------------------------------------------------------

def measure_load(engine_args: dict[str, Any], cached_repeats: int) -> dict[str, Any]:
    """LLM() wall time: cold (GGUF converted into an empty cache dir), then from that cache."""
    tmp = tempfile.mkdtemp(prefix="specserve-cache-")
    old = os.environ.get("SPECSERVE_CACHE_DIR")
    os.environ["SPECSERVE_CACHE_DIR"] = tmp
    try:
        def one(**extra: Any) -> tuple[float, float]:
            t = time.perf_counter()
            llm = LLM(**engine_args, **extra)
            wall = time.perf_counter() - t
            inner = llm.engine.load_time_s
            del llm
            gc.collect()
            return wall, inner

        cold = one()
        cached = [one() for _ in range(cached_repeats)]
        small_kv = [one(kv_cache_memory_gb=0.125) for _ in range(cached_repeats)]
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_CACHE_DIR", None)
        else:
            os.environ["SPECSERVE_CACHE_DIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "cold_gguf_s": cold[0],
        "cold_gguf_engine_load_time_s": cold[1],
        "cached_s_runs": [c[0] for c in cached],
        "cached_s": median([c[0] for c in cached]),
        "cached_engine_load_time_s": median([c[1] for c in cached]),
        "cached_kv_0.125gib_s": median([c[0] for c in small_kv]),
        "zeros_2gib_s": zeros_time(2 * 2**30),
        "note": "LLM(**engine_args) wall time in a warm process (imports excluded); engine_load_time_s is "
                "LLMEngine.load_time_s. cold/cached include zero-filling the default 2 GiB CPU KV cache "
                "(zeros_2gib_s: a bare torch.zeros of that size, for scale); cached_kv_0.125gib_s is the "
                "cached load with kv_cache_memory_gb=0.125.",
    }


def zeros_time(nbytes: int) -> float:
    t = time.perf_counter()
    z = torch.zeros(nbytes // 4, dtype=torch.float32)
    dt = time.perf_counter() - t
    del z
    return dt


# -- floor and profile --------------------------------------------------------------------------

def linear_floor_ms(llm: LLM, repeats: int = 20) -> dict[str, Any]:
    """Bare matmuls of one batch-1 token over every weight matrix (incl. the LM head): fp32 as the
    engine runs them, plus bf16 and int8 weight-only variants to show whether fewer bytes help here."""
    model = llm.engine.runner.model
    mats = [m.weight for m in model.modules() if type(m).__name__ == "Linear"]
    mats.append(model.lm_head_weight)
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in mats}

    def timed(fn: Callable[[], Any], reps: int) -> float:
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return 1000 * statistics.median(runs)

    F = torch.nn.functional
    with torch.inference_mode():
        ms = timed(lambda: [F.linear(xs[w.shape[1]], w) for w in mats], repeats)
        bf = [w.to(torch.bfloat16) for w in mats]
        bx = {k: v.to(torch.bfloat16) for k, v in xs.items()}
        bf_ms = timed(lambda: [F.linear(bx[w.shape[1]], w) for w in bf], 5)
        del bf
        q8 = []
        for w in mats:
            scale = w.abs().amax(1) / 127
            q8.append(((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale))
        try:
            i8_ms: float | None = timed(lambda: [torch._weight_int8pack_mm(xs[w.shape[1]], w, s) for w, s in q8], 5)
        except (RuntimeError, AttributeError):
            i8_ms = None
        del q8
    return {"ms": ms, "num_matrices": len(mats), "weight_mb": nbytes / 2**20,
            "effective_gb_s": nbytes / (ms / 1000) / 1e9,
            "bf16_f_linear_ms": bf_ms, "int8_weight_only_ms": i8_ms}


def forward_breakdown(llm: LLM, steps: int) -> dict[str, float]:
    """Median ms per decode step in each part of the target forward, from timing wrappers on module
    forwards and the attention backend (each wrapper adds ~1 us per call; ~330 calls per step)."""
    import specserve.models.llama as llama_mod

    eng = llm.engine
    model = eng.runner.model
    acc: dict[str, float] = {}
    restore: list[Callable[[], None]] = []

    def wrap(obj: Any, attr: str, label: str, instance: bool) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)
        restore.append((lambda: delattr(obj, attr)) if instance else (lambda: setattr(obj, attr, fn)))

    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind == "Linear":
            wrap(m, "forward", f"linear {name.rsplit('.', 1)[-1]}", True)
        elif kind == "RMSNorm":
            wrap(m, "forward", "RMSNorm x61", True)
        elif kind == "GatedMLP":
            wrap(m, "forward", "_mlp", True)
    wrap(eng.runner.attn, "forward", "paged attention x30 (KV write, gather, SDPA)", True)
    wrap(eng.runner.attn, "plan", "attention plan (once per step)", True)
    wrap(llama_mod, "apply_rotary", "rotary apply x30", False)
    wrap(model.rotary_emb, "forward", "rotary cos/sin gather", True)
    wrap(eng.runner, "forward", "_forward", True)
    per_step: list[dict[str, float]] = []
    try:
        for _ in range(steps):
            acc.clear()
            eng.step()
            per_step.append(dict(acc))
    finally:
        for r in reversed(restore):
            r()
    med = {k: 1000 * statistics.median(d.get(k, 0.0) for d in per_step) for k in per_step[0]}
    out = {k: v for k, v in med.items() if not k.startswith("_")}
    out["silu * up x30 (MLP minus its linears)"] = med["_mlp"] - med["linear gate_up_proj"] - med["linear down_proj"]
    out["rest of forward (embedding, residual adds, views, Python)"] = med["_forward"] - sum(out.values())
    out["forward total (excl. LM head)"] = med["_forward"]
    return out


def profile_decode(llm: LLM, prompt: list[int], steps: int) -> dict[str, Any]:
    """Batch-1 decode: time per engine phase, per module kind, and the torch.profiler op table."""
    import specserve.engine.sampler as sampler_mod

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=3 + 3 * steps + 4, ignore_eos=True)
    rid = f"decode-profile-{next(_ids)}"
    eng.add_request(rid, prompt, sp)
    req = eng.requests[rid]
    while req.num_output_tokens < 3:  # prefill + two warm decode steps
        eng.step()

    phases: dict[str, list[float]] = {}
    restore: list[Callable[[], None]] = []

    def wrap(obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.setdefault(label, []).append(time.perf_counter() - t)

        setattr(obj, attr, timed)
        restore.append(lambda: setattr(obj, attr, fn))

    wrap(eng.scheduler, "schedule", "scheduler.schedule")
    wrap(eng.runner, "prepare", "runner.prepare (host inputs)")
    wrap(eng.runner, "forward", "runner.forward (30 layers + final norm)")
    wrap(eng.runner.model, "compute_logits", "model.compute_logits (LM head)")
    wrap(sampler_mod, "sample", "sampler.sample")
    wrap(eng.scheduler, "commit", "scheduler.commit (+ detokenize)")
    step_times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            step_times.append(time.perf_counter() - t)
    finally:
        for r in reversed(restore):
            r()
    step_ms = 1000 * statistics.median(step_times)
    phase_ms = {k: 1000 * statistics.median(v) for k, v in phases.items()}
    phase_ms["other (engine.step bookkeeping, outputs)"] = step_ms - sum(phase_ms.values())

    modules_ms = forward_breakdown(llm, steps)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    return {
        "steps": steps,
        "context_tokens": len(prompt),
        "step_ms_median_unprofiled": step_ms,
        "phases_ms_median": phase_ms,
        "forward_by_module_ms_median": modules_ms,
        **op_table(prof, steps),
    }


def op_table(prof: Any, steps: int, top: int = 30) -> dict[str, Any]:
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
    mm = sum(e.self_cpu_time_total for e in ka if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv"))
    return {
        "profiler_self_ms_per_step_all_ops": sum(e.self_cpu_time_total for e in ka) / 1000 / steps,
        "profiler_matmul_self_ms_per_step": mm / 1000 / steps,
        "profiler_op_count_per_step": sum(e.count for e in ka) / steps,
        "top_ops_by_self_time": [
            {"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "total_ms_per_step": e.cpu_time_total / 1000 / steps} for e in rows[:top]],
    }


def profile_transformers(model: Any, prompt: list[int], steps: int) -> dict[str, Any]:
    """The same for transformers: op table of batch-1 decode forwards (past_key_values, greedy)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                out = model(nxt, past_key_values=pkv, use_cache=True)
                pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return {"steps": steps, "forward_ms_median_unprofiled": 1000 * statistics.median(times),
            **op_table(prof, steps, top=15)}


# -- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--output-len", type=int, default=32, help="new tokens per request (exact)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per batch size (disjoint prompts each)")
    ap.add_argument("--max-prompt-chars", type=int, default=600, help="skip longer ShareGPT first turns")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--profile-steps", type=int, default=10, help="batch-1 decode steps to profile (0: skip)")
    ap.add_argument("--skip-load", action="store_true", help="skip the load-time measurement")
    ap.add_argument("--quiet-threshold", type=float, default=0.3,
                    help="other processes' CPU use (cores) under which a run counts as quiet")
    ap.add_argument("--max-wait", type=float, default=60.0,
                    help="seconds to wait for a quiet machine before each specserve/transformers pair")
    ap.add_argument("--output-file", default="benchmarks/results/decode.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1 or args.output_len < 2 or args.repeats < 1:
        raise SystemExit("need batch sizes >= 1, --output-len >= 2, --repeats >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    result: dict[str, Any] = {"benchmark": "decode", **run_metadata()}
    path = default_model_path()
    hf, hf_load_s = load_transformers(path)
    result["transformers_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    result["transformers_gguf_load_s"] = hf_load_s

    max_b = max(batches)
    # a step budget that fits the largest batch's prompts: step 1 = prefill, later steps = pure decode
    # float32 as transformers runs here (dtype auto is bf16 on a CPU with bf16 units)
    engine_args = {"dtype": "float32", "max_num_batched_tokens": 16384, "max_num_seqs": max(256, max_b)}
    if not args.skip_load:
        wait_for_quiet(args.quiet_threshold, args.max_wait)
        probe = OtherCpu()
        result["load_time"] = measure_load(engine_args, cached_repeats=3)
        result["load_time"]["other_cpu_cores"] = probe.cores()
        print("load:", {k: v for k, v in result["load_time"].items() if k != "note"}, flush=True)
    llm = LLM(**engine_args)
    tok = llm.tokenizer
    pad_id = min(tok.eos_token_ids) if getattr(tok, "eos_token_ids", None) else 0
    result["engine_args"] = engine_args
    result["settings"] = {"batches": batches, "output_len": args.output_len, "repeats": args.repeats,
                          "max_prompt_chars": args.max_prompt_chars, "seed": args.seed,
                          "dtype": "float32", "greedy": True, "quiet_threshold": args.quiet_threshold}

    # disjoint prompt sets: repeat r of batch b uses its own slice, the same for both systems
    need = args.repeats * sum(batches) + 1
    pool = chat_prompt_ids(tok, need, seed=args.seed, max_chars=args.max_prompt_chars)
    sets: dict[tuple[int, int], list[list[int]]] = {}
    off = 1  # pool[0]: warm-up and profile prompt
    for r in range(args.repeats):
        for b in batches:
            sets[(r, b)] = pool[off : off + b]
            off += b

    print("warm-up", flush=True)
    run_specserve(llm, [pool[0]], 8)
    run_transformers(hf, [pool[0]], 8, pad_id)

    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for b in batches:
            order = ["specserve", "transformers"] if (r + batches.index(b)) % 2 == 0 else ["transformers", "specserve"]
            waited = time.perf_counter()
            before = wait_for_quiet(args.quiet_threshold, args.max_wait)
            waited = time.perf_counter() - waited
            got: dict[str, dict[str, Any]] = {}
            for system in order:
                la = load_average()
                probe = OtherCpu()
                if system == "specserve":
                    res = run_specserve(llm, sets[(r, b)], args.output_len)
                else:
                    res = run_transformers(hf, sets[(r, b)], args.output_len, pad_id)
                res["other_cpu_cores"] = probe.cores()
                res["load_average_before"] = la
                got[system] = res
            ss, tf = got["specserve"], got["transformers"]
            same = sum(a == c for a, c in zip(ss.pop("outputs"), tf.pop("outputs")))
            quiet = all((got[x]["other_cpu_cores"] or 0.0) < args.quiet_threshold for x in order)
            for system in order:
                runs.append({"repeat": r, "batch": b, "system": system, "order": order.index(system),
                             "prompt_tokens": [len(p) for p in sets[(r, b)]], "quiet_pair": quiet,
                             "other_cpu_cores_before_pair": before, "waited_for_quiet_s": waited, **got[system]})
            runs[-1]["identical_outputs_in_pair"] = runs[-2]["identical_outputs_in_pair"] = f"{same}/{b}"
            print(f"repeat {r} batch {b:3d}: specserve {ss['decode_tok_s']:8.1f} tok/s "
                  f"({ss['ms_per_step_median']:.1f} ms/step) | transformers {tf['decode_tok_s']:8.1f} tok/s "
                  f"({tf['ms_per_step_median']:.1f} ms/step) | x{ss['decode_tok_s'] / tf['decode_tok_s']:.2f} "
                  f"| same outputs {same}/{b} | other cpu {ss['other_cpu_cores']:.2f}/{tf['other_cpu_cores']:.2f}"
                  f"{'' if quiet else ' (NOISY)'}", flush=True)
    result["runs"] = runs

    summary = []
    for b in batches:
        all_pairs = [(x, y) for x in runs for y in runs if x["batch"] == y["batch"] == b
                     and x["repeat"] == y["repeat"] and x["system"] == "specserve" and y["system"] == "transformers"]
        pairs = [p for p in all_pairs if p[0]["quiet_pair"]] or all_pairs
        row: dict[str, Any] = {"batch": b, "pairs_used": len(pairs), "pairs_quiet": sum(p[0]["quiet_pair"] for p in all_pairs),
                               "pairs_total": len(all_pairs)}
        for name, i in (("specserve", 0), ("transformers", 1)):
            row[f"{name}_decode_tok_s"] = median([p[i]["decode_tok_s"] for p in pairs])
            row[f"{name}_ms_per_step"] = median([p[i]["ms_per_step_median"] for p in pairs])
            row[f"{name}_prefill_s"] = median([p[i]["prefill_s"] for p in pairs])
        row["speedup_tok_s"] = median([p[0]["decode_tok_s"] / p[1]["decode_tok_s"] for p in pairs])
        row["speedup_ms_per_step"] = median([p[1]["ms_per_step_median"] / p[0]["ms_per_step_median"] for p in pairs])
        row["speedup_tok_s_all_pairs"] = median([p[0]["decode_tok_s"] / p[1]["decode_tok_s"] for p in all_pairs])
        row["identical_outputs"] = [p[0]["identical_outputs_in_pair"] for p in all_pairs]
        summary.append(row)
    result["summary"] = summary
    result["summary_note"] = ("medians over quiet pairs (other processes < quiet_threshold cores during both runs), "
                              "over all pairs when none was quiet; speedup = median of per-pair ratios")

    def quiet_then(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = wait_for_quiet(args.quiet_threshold, args.max_wait)
        probe = OtherCpu()
        out = fn()
        return {**out, "other_cpu_cores_before": before, "other_cpu_cores": probe.cores()}

    result["linear_floor_batch1"] = quiet_then(lambda: linear_floor_ms(llm))
    if args.profile_steps > 0:
        result["profile_batch1"] = quiet_then(lambda: profile_decode(llm, pool[0], args.profile_steps))
        result["profile_batch1_transformers"] = quiet_then(lambda: profile_transformers(hf, pool[0], args.profile_steps))
    write_json(args.output_file, result)

    print(f"\n{'batch':>5} {'specserve tok/s':>16} {'ms/step':>8} {'transformers tok/s':>19} {'ms/step':>8} {'speed-up':>9}")
    for row in summary:
        print(f"{row['batch']:>5} {row['specserve_decode_tok_s']:>16.1f} {row['specserve_ms_per_step']:>8.1f} "
              f"{row['transformers_decode_tok_s']:>19.1f} {row['transformers_ms_per_step']:>8.1f} "
              f"{row['speedup_tok_s']:>8.2f}x  ({row['pairs_used']} pairs)")
    return result


if __name__ == "__main__":
    main()
