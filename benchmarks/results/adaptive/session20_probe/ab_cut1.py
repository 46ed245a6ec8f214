"""A/B of the per-request depth cut at one request, in one run: the adaptive engine as committed
("adaptive": no cut when the batch is one request) against the same engine cutting a lone request's
depth by its own rates as before ("adaptive_cut1": cut_min_batch 1), beside no-spec and static
chains, stepped round robin (session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session20_probe/ab_cut1.py --concurrency 1,1 \
        --static-steps 2,3 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import run_ab  # noqa: E402


def cut_single(llm) -> None:
    llm.engine.drafter.controller.cut_min_batch = 1


if __name__ == "__main__":
    run_ab("adaptive_cut1", cut_single, "adaptive_session20_cut1_ab")
