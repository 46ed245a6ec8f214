"""A/B of session 19's two controller changes, in one run: the adaptive engine as committed
("adaptive": prompt-carrying cycles measured up to a 0.75 prompt share, and the bar for turning
drafting on repaid over the pick's stay so far) against the same engine with both undone
("adaptive_old": prefill_share_limit 0.25, stay_horizon 0), beside no-spec and static chains,
stepped round robin (session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session19_probe/ab_bar.py --concurrency 16,32,4,8 \
        --static-steps 1,2 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import run_ab  # noqa: E402


def old(llm) -> None:
    ctl = llm.engine.drafter.controller
    ctl.prefill_share_limit = 0.25
    ctl.bandit.stay_horizon = 0


if __name__ == "__main__":
    run_ab("adaptive_old", old, "adaptive_session19_ab")
