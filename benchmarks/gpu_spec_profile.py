"""Where a speculative step's time goes on the GPU (C=1, greedy): per-phase wall times and top ops.

Uses dummy target weights (only timing matters) and the shipped head:
    python3 benchmarks/gpu_spec_profile.py --model DIR_WITH_CONFIG_AND_TOKENIZER --out $OUT/gpu_spec_profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(obj, name, bucket):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        bucket.setdefault(name, []).append(time.perf_counter() - t0)
        return r

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="gpu_spec_profile.json")
    args = ap.parse_args()
    from specserve import LLM, SamplingParams

    prompt = [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}]
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    res = {}
    for name, kw in {"no-spec": {}, "chain-3": dict(speculative_num_steps=3),
                     "chain-3-eager": dict(speculative_num_steps=3, enforce_eager=True)}.items():
        extra = dict(speculative_algorithm="EAGLE3", speculative_policy="static", **kw) if "chain" in name else {}
        if "enforce_eager" in extra:
            extra.pop("enforce_eager")
            extra["enforce_eager"] = True
        llm = LLM(model=args.model, load_format="dummy", num_kv_blocks=2048, max_num_seqs=8, **extra)
        llm.chat([prompt], SamplingParams(temperature=0, max_tokens=8))
        bucket: dict = {}
        d = llm.engine.drafter
        if d is not None:
            timed(d, "verify_step", bucket)
            timed(d, "draft_step", bucket)
        else:
            timed(llm.engine.runner, "execute", bucket)
        t0 = time.perf_counter()
        out = llm.chat([prompt], sp)[0]
        dt = time.perf_counter() - t0
        r = {"tok_per_s": len(out.outputs[0].token_ids) / dt, "steps": len(next(iter(bucket.values())))}
        r.update({f"{k}_ms_median": sorted(v)[len(v) // 2] * 1e3 for k, v in bucket.items()})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.chat([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18)
        print(name, json.dumps(r))
        print(table[:6000])
        r["profile_top"] = table
        res[name] = r
        del llm
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
