"""Offline held-out acceptance of EAGLE-3 heads: the trainer's own measurement, for heads side by side.

The target's greedy replies (up to --max-tokens) to the first user turn of held-out ShareGPT
conversations (the split the trainer uses: the first --heldout indices of
random.Random(--split-seed).shuffle(range(n))), then for each head and every position of each reply:
how many leading chain steps it drafts right with its own hidden states fed back (exact greedy
chain accept length per k), and whether the target's token is in its top-4 at each step (the
upper bound of a top-4 tree of depth k). All heads see the same replies.

    python benchmarks/heldout_acceptance.py --heads models/smollm2-135m-eagle3 /path/to/other_head \\
        --output-file benchmarks/results/heldout_acceptance.json

With ``--tasks FILE`` (a held-out multi-task set, benchmarks/data/heldout_tasks.json) it measures in the
engine instead, per task: greedy, natural stops, up to --max-tokens, policy static, one engine per
head and configuration (spec_single's CONFIGS) running all prompts; per task the accept length per
verify step ((accepted + verify steps) / verify steps, SGLang's count, from each request's own
counts), and the share of the replies' tokens the head's draft vocab holds. ``--chat N`` adds the
chat benchmarks' first N ShareGPT prompts (benchmarks/accept_length.py's) as the task "sharegpt".

    python benchmarks/heldout_acceptance.py --tasks benchmarks/data/heldout_tasks.json \\
        --heads models/smollm2-135m-eagle3 --configs chain5,tree --chat 32 --output-file $OUT/tasks.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specserve.bench.harness import chat_prompt_ids, run_metadata, write_json  # noqa: E402
from spec_single import CONFIGS  # noqa: E402

from specserve.models.eagle3 import Eagle3DraftModel  # noqa: E402
from specserve.train import data as D  # noqa: E402
from specserve.train.eagle3 import accept_runs, acceptance_report, heldout_examples  # noqa: E402
from specserve.train.target import load_target, resolve_device  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", required=True, help="EAGLE-3 head directories")
    ap.add_argument("--model", default=None, help="target (default: the default model)")
    ap.add_argument("--data", default="sharegpt", help="'sharegpt' or the JSONL the heads were trained from")
    ap.add_argument("--heldout", type=int, default=1000)
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64, help="concurrent sequences while generating the replies")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--output-file", default=None)
    g = ap.add_argument_group("per task, in the engine (--tasks)")
    g.add_argument("--tasks", default=None, help="a held-out task file: measure in the engine, per task")
    g.add_argument("--per-task", type=int, default=None, help="the first N prompts of each task")
    g.add_argument("--chat", type=int, default=0, help="add the chat benchmarks' first N ShareGPT prompts")
    g.add_argument("--configs", default="chain5,tree", help=f"comma-separated, of {list(CONFIGS)}")
    g.add_argument("--dtype", default="auto", help="engine dtype (auto: the engine's: bf16 on a GPU and a CPU with bf16 units)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.tasks:
        return engine_tasks(args)

    device = resolve_device(args.device)
    target = load_target(args.model, device)
    convs = D.load_conversations(args.data)
    _, held_idx = D.heldout_split(len(convs), args.heldout, args.split_seed)
    t0 = time.monotonic()
    examples = heldout_examples(target, [(i, convs[i]) for i in held_idx], args.num_prompts, args.max_tokens,
                                args.max_prompt_len, "engine", args.batch)
    gen_s = time.monotonic() - t0
    print(f"{len(examples)} held-out replies in {gen_s:.0f} s", flush=True)
    result: dict[str, Any] = {"meta": run_metadata(), "settings": {**vars(args), "replies": len(examples),
                                                                   "target_dtype": str(target.dtype)},
                              "heads": {}}
    for path in args.heads:
        head = Eagle3DraftModel.from_pretrained(path, device=device, dtype=torch.float32).eval()
        t0 = time.monotonic()
        runs = accept_runs(head, target, examples, steps=args.steps, topk=4, batch_tokens=8192)
        rep = acceptance_report(runs, args.steps, topk=4)
        rep["seconds"] = round(time.monotonic() - t0, 1)
        result["heads"][path] = rep
        chain = " ".join(f"{k}:{v:.2f}" for k, v in rep["chain_accept_length"].items())
        bound = " ".join(f"{k}:{v:.2f}" for k, v in rep["topk_path_accept_length"].items())
        print(f"{path}\n  chain tau {chain}\n  top-4 tree bound {bound}", flush=True)
    if args.output_file:
        write_json(args.output_file, result)
    return result


def task_prompts(path: str, per_task: int | None) -> list[tuple[str, str, list[dict[str, str]]]]:
    """(task, id, messages) of a held-out task file, the first ``per_task`` of each task."""
    with open(path) as f:
        d = json.load(f)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for p in d["prompts"]:
        if per_task is None or seen[p["task"]] < per_task:
            seen[p["task"]] += 1
            out.append((p["task"], p["id"], p["messages"]))
    return out


def engine_tasks(args: argparse.Namespace) -> dict[str, Any]:
    """Per task and per head x configuration: the engine's accept length (see the module doc)."""
    from specserve import LLM, SamplingParams

    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if not CONFIGS.get(c)]
    if bad:
        raise SystemExit(f"unknown or non-speculative configs {bad}; choose from {[c for c in CONFIGS if CONFIGS[c]]}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    items = task_prompts(args.tasks, args.per_task)
    common = dict(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  max_num_seqs=len(items) + args.chat, speculative_algorithm="EAGLE3", speculative_policy="static")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result: dict[str, Any] = {"benchmark": "heldout_acceptance_tasks", **run_metadata(),
                              "settings": {"tasks_file": args.tasks, "per_task": args.per_task, "chat": args.chat,
                                           "max_tokens": args.max_tokens, "greedy": True, "policy": "static",
                                           "configs": {c: CONFIGS[c] for c in names}},
                              "heads": {}}
    ids = None
    t_all = time.monotonic()
    for path in args.heads:
        t2d = Eagle3DraftModel.from_pretrained(path).t2d.bool()
        rows: dict[str, Any] = {}
        for name in names:
            t0 = time.monotonic()
            llm = LLM(**common, speculative_draft_model_path=path, **CONFIGS[name])
            if ids is None:
                tok = llm.tokenizer
                ids = [D.render_ids(tok, m, add_generation_prompt=True) for _, _, m in items]
                tasks = [t for t, _, _ in items]
                if args.chat:
                    ids += chat_prompt_ids(tok, args.chat, seed=0)
                    tasks += ["sharegpt"] * args.chat
                result["settings"]["prompts_per_task"] = {t: tasks.count(t) for t in dict.fromkeys(tasks)}
            outs = llm.generate(ids, sp, use_tqdm=False)
            per: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # verify, accepted, tokens, in vocab
            for t, o in zip(tasks, outs):
                toks = list(o.outputs[0].token_ids)
                for key in (t, "all"):
                    c = per[key]
                    c[0] += o.metrics.spec_verify_steps
                    c[1] += o.metrics.spec_accepted_tokens
                    c[2] += len(toks)
                    c[3] += int(t2d[torch.tensor(toks, dtype=torch.long)].sum()) if toks else 0
            rows[name] = {k: {"accept_length": round((a + v) / v, 3) if v else None, "verify_steps": v,
                              "accepted_tokens": a, "output_tokens": n,
                              "draft_vocab_coverage": round(cov / n, 4) if n else None}
                          for k, (v, a, n, cov) in per.items()}
            means = [r["accept_length"] for k, r in rows[name].items() if k not in ("all", "sharegpt")]
            rows[name]["mean_of_tasks"] = round(sum(means) / len(means), 3) if None not in means and means else None
            # the engine's own count over all requests: "all" sums the requests' counts, so the two agree
            rows[name]["engine_accept_length"] = round(llm.engine.get_stats().avg_accept_length or 0, 3)
            rows[name]["seconds"] = round(time.monotonic() - t0, 1)
            print(f"{path} {name} ({rows[name]['seconds']} s): " + ", ".join(
                f"{k} {r['accept_length']}" for k, r in rows[name].items() if isinstance(r, dict)), flush=True)
            del llm, outs
        result["heads"][path] = rows
    result["elapsed_s"] = round(time.monotonic() - t_all, 1)
    print(markdown_table(result), flush=True)
    if args.output_file:
        write_json(args.output_file, result)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    """Rows: task; columns: head x configuration (accept length per verify step)."""
    cols = [(h, c) for h, rows in result["heads"].items() for c in rows]
    tasks = list(result["settings"]["prompts_per_task"]) + ["all"]
    lines = ["| task | " + " | ".join(f"{os.path.basename(os.path.normpath(h))} {c}" for h, c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for t in tasks:
        cells = [result["heads"][h][c].get(t, {}).get("accept_length") for h, c in cols]
        lines.append(f"| {t} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |")
    means = [result["heads"][h][c]["mean_of_tasks"] for h, c in cols]
    lines.append("| mean of tasks | " + " | ".join("-" if v is None else f"{v:.2f}" for v in means) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
