"""A/B of picking among served arms only (session 21), in one run: the adaptive engine as committed
("adaptive": once arms in a bucket have served cycles, an arm known only by its prior or fading
start-up seeds is explored, not picked) against the same engine picking any arm by its estimate as
before ("adaptive_any": pick_cycles 0), beside no-spec and static chains, stepped round robin
(session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session21_probe/ab_pick.py --concurrency 32,16 \
        --static-steps 1,2 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import run_ab  # noqa: E402


def pick_any(llm) -> None:
    llm.engine.drafter.controller.bandit.pick_cycles = 0.0


if __name__ == "__main__":
    run_ab("adaptive_any", pick_any, "adaptive_session21_pick_ab")
