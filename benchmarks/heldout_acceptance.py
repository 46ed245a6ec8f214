"""Offline held-out acceptance of EAGLE-3 heads: the trainer's own measurement, for heads side by side.

The target's greedy replies (up to --max-tokens) to the first user turn of held-out ShareGPT
conversations (the split the trainer uses: the first --heldout indices of
random.Random(--split-seed).shuffle(range(n))), then for each head and every position of each reply:
how many leading chain steps it drafts right with its own hidden states fed back (exact greedy
chain accept length per k), and whether the target's token is in its top-4 at each step (the
upper bound of a top-4 tree of depth k). All heads see the same replies.

    python benchmarks/heldout_acceptance.py --heads models/smollm2-135m-eagle3 /path/to/other_head \\
        --output-file benchmarks/results/heldout_acceptance.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from specserve.bench.harness import run_metadata, write_json
from specserve.models.eagle3 import Eagle3DraftModel
from specserve.train import data as D
from specserve.train.eagle3 import accept_runs, acceptance_report, heldout_examples
from specserve.train.target import load_target, resolve_device


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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    main()
