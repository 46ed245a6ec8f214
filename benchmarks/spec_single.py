"""Concurrency-1 speed and accept length of EAGLE-3 speculation on SmolLM2-135M-Instruct (or --model; CPU).

One engine per configuration, all in this process, all on the same target weights and draft head:

    nospec           no speculation
    chain2..chain7   speculative_num_steps 2, 3, 5, 7, topk 1 (a chain)
    tree             steps 5, topk 4, 16 draft tokens (EAGLE-2 dynamic tree)
    tree8, tree12    the same tree with 8 or 12 draft tokens (a cheaper verify)
    tree6x10, tree4x8  6 steps x top-4 x 10 tokens, 4 steps x top-4 x 8 tokens
    tree6x8, tree7x10, tree7x12, tree8x12  deeper small trees (steps x top-4 x draft tokens)
    tree24, tree32   5 steps x top-4 with 24 or 32 draft tokens
    tree6x24, tree6x32, tree7x32, tree7x48, tree8x64  deeper trees (steps x top-4 x draft tokens)
    tree48, tree64, tree5x6x32, tree5x6x48, tree5x8x64  more nodes, wider frontiers (steps x top-k x tokens)
    default          the engine's own speculation defaults (what `specserve serve` drafts)

Each ShareGPT chat prompt runs alone (concurrency 1) through every configuration in turn, the
order rotating from prompt to prompt; greedy, exactly ``--output-len`` new tokens (or up to it and
the natural end of turn with ``--natural-stop``), policy
``static`` (always draft), or the adaptive policy for a name ending in ``+adaptive`` (``tree8+adaptive``;
``default`` is adaptive as the engine's default is); ``@float32`` sets the head's own dtype. Per
configuration: tokens/s end to end (prefill included) and over the decode part only (after the first
token), accept length from RequestOutput.metrics
((accepted + verify steps) / verify steps, SGLang's count), per-position acceptance from
engine.get_stats(), and whether the output tokens equal the no-spec ones (greedy is lossless).

Head: --draft PATH; by default the shipped head at models/smollm2-135m-eagle3 when it exists, else
a random head in the public EAGLE-3 layout (draft vocab 8192) built in a temp dir, whose accept
length is ~1 and speed-up < 1 by construction.

    python benchmarks/spec_single.py --output-file benchmarks/results/spec_single.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import tempfile
import time
from typing import Any

import torch

from specserve import LLM, SamplingParams
from specserve.bench.harness import (REPO, OtherCpu, chat_prompt_ids, load_average, make_random_head, median,
                                     run_metadata, wait_for_quiet, write_json)

DEFAULT_HEAD = os.path.join(REPO, "models", "smollm2-135m-eagle3")
CONFIGS: dict[str, dict[str, Any]] = {
    "nospec": {},
    "chain2": {"speculative_num_steps": 2, "speculative_eagle_topk": 1},
    "chain3": {"speculative_num_steps": 3, "speculative_eagle_topk": 1},
    "chain5": {"speculative_num_steps": 5, "speculative_eagle_topk": 1},
    "chain7": {"speculative_num_steps": 7, "speculative_eagle_topk": 1},
    "tree": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16},
    # larger trees: at one request on a GPU a verify of 24-32 tokens costs about what one of 16 does
    "tree24": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 24},
    "tree32": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 32},
    "tree6x24": {"speculative_num_steps": 6, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 24},
    # deeper trees: at one request the H200 cycle is host-bound, so tokens per verify are what pays
    "tree6x32": {"speculative_num_steps": 6, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 32},
    "tree7x32": {"speculative_num_steps": 7, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 32},
    "tree7x48": {"speculative_num_steps": 7, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 48},
    "tree8x64": {"speculative_num_steps": 8, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 64},
    # more nodes at depth 5 (the H200's tree cycle is device-bound and its verify costs the same up to 64
    # tokens), and wider frontiers (top-6, top-8: the expansion runs one query per frontier node)
    "tree48": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 48},
    "tree64": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 64},
    "tree5x6x32": {"speculative_num_steps": 5, "speculative_eagle_topk": 6, "speculative_num_draft_tokens": 32},
    "tree5x6x48": {"speculative_num_steps": 5, "speculative_eagle_topk": 6, "speculative_num_draft_tokens": 48},
    "tree5x8x64": {"speculative_num_steps": 5, "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 64},
    "tree8": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
    "tree12": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 12},
    "tree6x10": {"speculative_num_steps": 6, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 10},
    "tree4x8": {"speculative_num_steps": 4, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
    # deeper small trees: on two CPU cores a verify's cost grows with its tokens, the head's with its depth
    "tree6x8": {"speculative_num_steps": 6, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
    "tree7x10": {"speculative_num_steps": 7, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 10},
    "tree7x12": {"speculative_num_steps": 7, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 12},
    "tree8x12": {"speculative_num_steps": 8, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 12},
}
POLICIES = ("static", "adaptive")
NAMES = [*CONFIGS, "default"]


def config_args(name: str) -> dict[str, Any]:
    """Engine args of a configuration name: ``tree8`` (static policy), ``tree8+adaptive``, ``default``,
    each optionally with the head's own dtype: ``tree8@float32``."""
    name, _, draft_dtype = name.partition("@")
    shape, _, policy = name.partition("+")
    if (shape not in NAMES or (policy and policy not in POLICIES) or (shape == "nospec" and (policy or draft_dtype))
            or draft_dtype not in ("", "float32", "bfloat16")):
        raise ValueError(f"unknown configuration {name!r}: one of {NAMES}, optionally +adaptive and @float32")
    if shape == "nospec":
        return {}
    return {**CONFIGS.get(shape, {}), "speculative_algorithm": "EAGLE3",
            "speculative_policy": policy or ("adaptive" if shape == "default" else "static"),
            **({"speculative_draft_dtype": draft_dtype} if draft_dtype else {})}


_ids = itertools.count()


def head_provenance(path: str) -> dict[str, Any]:
    """sha256 and mtime of the head's weights, so a result names the exact head it measured."""
    import datetime
    import hashlib

    f = os.path.join(path, "model.safetensors")
    if not os.path.isfile(f):
        return {}
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    mtime = datetime.datetime.fromtimestamp(os.path.getmtime(f), datetime.timezone.utc).isoformat(timespec="seconds")
    return {"model_safetensors_sha256": h.hexdigest(), "model_safetensors_mtime": mtime}


def run_one(llm: LLM, prompt: list[int], output_len: int, natural_stop: bool = False) -> dict[str, Any]:
    """One request alone; step timestamps split prefill (until the first token) from decode."""
    eng = llm.engine
    rid = f"spec-bench-{next(_ids)}"
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=not natural_stop))
    req = eng.requests[rid]
    final = None
    t_first = None
    n_first = 0
    steps = 0
    steps_first = 0
    while final is None:
        outs = eng.step()
        steps += 1
        now = time.perf_counter()
        if t_first is None and req.num_output_tokens >= 1:
            t_first, n_first, steps_first = now, req.num_output_tokens, steps
        final = next((o for o in outs if o.request_id == rid and o.finished), None)
        if final is None and not eng.has_unfinished_requests():
            raise RuntimeError(f"engine went idle before {rid} finished")
    t_end = time.perf_counter()
    m = final.metrics
    n = len(final.outputs[0].token_ids)
    assert t_first is not None
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": n,
        "total_s": t_end - t0,
        "prefill_s": t_first - t0,
        "tok_s": n / (t_end - t0),
        "decode_tok_s": (n - n_first) / (t_end - t_first) if t_end > t_first else None,
        "engine_steps": steps,
        # one engine step = one target forward (plus drafting when speculating)
        "decode_ms_per_step": 1000 * (t_end - t_first) / (steps - steps_first) if steps > steps_first else None,
        "spec_verify_steps": m.spec_verify_steps,
        "spec_draft_tokens": m.spec_draft_tokens,
        "spec_accepted_tokens": m.spec_accepted_tokens,
        "accept_length": m.accept_length,
        "token_ids": list(final.outputs[0].token_ids),
    }


def stats_delta(after: Any, before: Any) -> dict[str, Any]:
    """Engine counters accumulated between two get_stats() snapshots (warm-up excluded)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(after):
        a, b = getattr(after, f.name), getattr(before, f.name)
        if f.name in ("num_running", "num_waiting", "kv_usage"):
            continue
        if isinstance(a, list):
            out[f.name] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        elif isinstance(a, dict):
            out[f.name] = {str(k): v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}
        else:
            out[f.name] = a - b
    vs = out.get("spec_verify_steps") or 0
    out["avg_accept_length"] = (out["spec_accepted_tokens"] + vs) / vs if vs else None
    drafted, accepted = out.get("spec_drafted_per_position") or [], out.get("spec_accepted_per_position") or []
    out["acceptance_rate_per_position"] = [a / d if d else None for a, d in zip(accepted, drafted)]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target: GGUF file or HF directory (default: SmolLM2; another "
                    "needs --draft); a model without a chat template gets the prompts as completions")
    ap.add_argument("--draft", default=None, help="EAGLE-3 head directory (default: the shipped head, else random)")
    ap.add_argument("--random-head", action="store_true", help="use a random head even when the shipped one exists")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=64,
                    help="new tokens per request (exact; with --natural-stop, the most)")
    ap.add_argument("--natural-stop", action="store_true",
                    help="stop at the model's end of turn as a chat user would see it (default: ignore_eos, "
                         "exactly --output-len tokens, text past the natural end included)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of {NAMES}, each optionally +adaptive (adaptive policy) and "
                         "@float32 (the head's dtype)")
    ap.add_argument("--max-prompt-chars", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    ap.add_argument("--prompt-offset", type=int, default=0,
                    help="skip this many prompts of the seeded order (a set disjoint from the first ones)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--dtype", default="auto", help="engine dtype (default: the engine's)")
    ap.add_argument("--no-cpu-weight-packing", dest="cpu_weight_packing", action="store_false",
                    help="plain F.linear instead of oneDNN-packed weights")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=0.5, help="KV budget per engine (all engines alike)")
    ap.add_argument("--quiet-threshold", type=float, default=0.3,
                    help="other processes' CPU use (cores) under which a run counts as quiet")
    ap.add_argument("--max-wait", type=float, default=30.0, help="seconds to wait for a quiet machine per prompt")
    ap.add_argument("--output-file", default="benchmarks/results/spec_single.json")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    try:
        for n in names:
            config_args(n)
    except ValueError as e:
        raise SystemExit(f"--configs: {e}") from None
    if "nospec" not in names:
        raise SystemExit("--configs must include nospec (the baseline)")
    if args.num_prompts < 1 or args.output_len < 2:
        raise SystemExit("need --num-prompts >= 1 and --output-len >= 2")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    result: dict[str, Any] = {"benchmark": "spec_single", **run_metadata()}
    tmp = None
    if args.draft and args.random_head:
        raise SystemExit("--draft and --random-head exclude each other")
    if args.model and not args.draft:
        raise SystemExit("--model needs --draft (the shipped and random heads are the default model's)")
    if args.draft:
        head, head_kind = os.path.abspath(args.draft), "given"
    elif os.path.isfile(os.path.join(DEFAULT_HEAD, "config.json")) and not args.random_head:
        head, head_kind = DEFAULT_HEAD, "shipped"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="random-eagle3-")
        head, head_kind = make_random_head(os.path.join(tmp.name, "head")), "random (std 0.02, draft vocab 8192)"
    result["draft_head"] = {"path": head, "kind": head_kind, **head_provenance(head)}
    print(f"draft head: {head} ({head_kind})", flush=True)

    base = {"model": args.model, "kv_cache_memory_gb": args.kv_cache_memory_gb, "dtype": args.dtype,
            "cpu_weight_packing": args.cpu_weight_packing}
    engines: dict[str, LLM] = {}
    engine_args: dict[str, dict[str, Any]] = {}
    for name in names:
        spec = config_args(name)
        if spec:
            spec["speculative_draft_model_path"] = head
        engine_args[name] = {**base, **spec}
        engines[name] = LLM(**engine_args[name])
    result["engine_args"] = engine_args
    result["settings"] = {"num_prompts": args.num_prompts, "output_len": args.output_len, "seed": args.seed,
                          "prompt_offset": args.prompt_offset,
                          "quiet_threshold": args.quiet_threshold,
                          "max_prompt_chars": args.max_prompt_chars, "greedy": True, "concurrency": 1,
                          "natural_stop": args.natural_stop}

    tok = engines["nospec"].tokenizer
    prompts = chat_prompt_ids(tok, args.num_prompts + 1, seed=args.seed, max_chars=args.max_prompt_chars,
                              start=args.prompt_offset)
    warm, prompts = prompts[0], prompts[1:]
    before = {}
    for name, llm in engines.items():
        run_one(llm, warm, 8)
        before[name] = llm.engine.get_stats()

    runs: list[dict[str, Any]] = []
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        wait_for_quiet(args.quiet_threshold, args.max_wait)
        got = {}
        for name in order:
            la = load_average()
            probe = OtherCpu()
            got[name] = run_one(engines[name], p, args.output_len, args.natural_stop)
            got[name]["other_cpu_cores"] = probe.cores()
            got[name]["load_average_before"] = la
        ref = got["nospec"]["token_ids"]
        quiet = all((got[n]["other_cpu_cores"] or 0.0) < args.quiet_threshold for n in order)
        for name in order:
            r = got[name]
            r["same_tokens_as_nospec"] = r["token_ids"] == ref
            runs.append({"prompt_index": i, "config": name, "order": order.index(name), "quiet_group": quiet,
                         **{k: v for k, v in r.items() if k != "token_ids"}})
        print(f"prompt {i} ({len(p)} tok): " + " | ".join(
            f"{n} {got[n]['tok_s']:.1f} tok/s" + (f" al {got[n]['accept_length']:.2f}" if got[n]["accept_length"] else "")
            for n in names) + f" | other cpu {max(got[n]['other_cpu_cores'] or 0 for n in names):.2f}"
            + ("" if quiet else " (NOISY)"), flush=True)
    result["runs"] = runs

    quiet_prompts = {r["prompt_index"] for r in runs if r["quiet_group"]}
    timed = [r for r in runs if r["prompt_index"] in quiet_prompts] or runs
    result["timing_note"] = (f"tok/s and speed-ups over the {len({r['prompt_index'] for r in timed})} prompts whose runs "
                             f"were all quiet (other processes < {args.quiet_threshold} cores), all prompts if none; "
                             "accept length and token equality over all prompts")
    summary = []
    for name in names:
        mine = [r for r in timed if r["config"] == name]
        mine_all = [r for r in runs if r["config"] == name]
        base_runs = {r["prompt_index"]: r for r in runs if r["config"] == "nospec"}
        tokens = sum(r["output_tokens"] for r in mine)
        row = {
            "config": name,
            **{k.replace("speculative_", ""): v for k, v in config_args(name).items() if k != "speculative_algorithm"},
            "tok_s": tokens / sum(r["total_s"] for r in mine),
            "decode_tok_s_median": median([r["decode_tok_s"] for r in mine]),
            "decode_ms_per_step_median": median([r["decode_ms_per_step"] for r in mine]),
                        # tok/s ratio: equal to the time ratio when outputs are equal, fair when (bf16) lengths differ
            "speedup_vs_nospec_median": median([r["tok_s"] / base_runs[r["prompt_index"]]["tok_s"] for r in mine]),
            "accept_length": None,
            "prompts_timed": len(mine),
            "same_tokens_as_nospec": f"{sum(r['same_tokens_as_nospec'] for r in mine_all)}/{len(mine_all)}",
            "engine_stats": stats_delta(engines[name].engine.get_stats(), before[name]),
        }
        drafter = engines[name].engine.drafter
        if drafter is not None:  # draft paths taken (tree depths skipped as final, graph or eager, ...)
            row["draft_path_counts"] = dict(drafter.path_counts)
        vs = sum(r["spec_verify_steps"] for r in mine_all)
        if vs:
            row["accept_length"] = (sum(r["spec_accepted_tokens"] for r in mine_all) + vs) / vs
            row["accept_length_per_prompt_median"] = median([r["accept_length"] for r in mine_all])
        summary.append(row)
    base_ms = summary[names.index("nospec")]["decode_ms_per_step_median"]
    for row in summary:
        # a speculative step pays off once it yields more tokens than its cost in plain decode steps
        ms = row["decode_ms_per_step_median"]
        row["step_cost_vs_nospec_step"] = ms / base_ms if ms and base_ms else None
    result["summary"] = summary
    write_json(args.output_file, result)

    print(f"\n{'config':>14} {'tok/s':>7} {'decode tok/s':>13} {'ms/step':>8} {'x nospec step':>14} {'speed-up':>9} "
          f"{'accept len':>11} {'same':>6}")
    for row in summary:
        al = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
        print(f"{row['config']:>14} {row['tok_s']:>7.2f} {row['decode_tok_s_median']:>13.2f} "
              f"{row['decode_ms_per_step_median']:>8.1f} {row['step_cost_vs_nospec_step']:>14.2f} "
              f"{row['speedup_vs_nospec_median']:>8.2f}x {al:>11} {row['same_tokens_as_nospec']:>6}")
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
