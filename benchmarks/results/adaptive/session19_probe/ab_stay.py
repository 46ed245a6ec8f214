"""A/B of the stay horizon alone (session 19, after the 0.75 prompt share was reverted), in one run:
the adaptive engine as committed ("adaptive": the bar for turning drafting on repaid over the
pick's stay so far) against the same engine with it undone ("adaptive_old": stay_horizon 0, the
64-cycle bar), beside no-spec and static chains, stepped round robin (session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session19_probe/ab_stay.py --concurrency 32,16 \
        --static-steps 1,2 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import run_ab  # noqa: E402


def old(llm) -> None:
    llm.engine.drafter.controller.bandit.stay_horizon = 0


if __name__ == "__main__":
    run_ab("adaptive_old", old, "adaptive_stay_horizon_ab")
