"""A/B of how a prompt-carrying cycle is admitted to its depth's measure, in one run: the adaptive
engine as committed ("adaptive": left out where the prompt tokens' predicted share is above 0.25 of
the cycle's measured time) against the same engine testing that share against a plain step of the
same requests instead, up to 0.75 ("adaptive_plainshare": one test for every depth, since a drafting
cycle's longer time no longer lowers its share), beside no-spec and static chains, stepped round
robin (session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session20_probe/ab_share.py --concurrency 32,16 \
        --static-steps 1,2 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_ab"))
from ab import run_ab  # noqa: E402


def plain_share(llm) -> None:
    ctl = llm.engine.drafter.controller
    ctl.share_of_plain = True
    ctl.prefill_share_limit = 0.75


if __name__ == "__main__":
    run_ab("adaptive_plainshare", plain_share, "adaptive_session20_share_ab")
