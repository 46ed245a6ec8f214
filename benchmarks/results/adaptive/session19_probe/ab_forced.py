"""Session 19 probe: at high concurrency, is the adaptive engine behind static chains for its choices
or for its machinery? The adaptive engine as committed ("adaptive") against the same engine held at
one arm for every request ("adaptive_k<N>", controller.forced_arm = N: no decisions, no
explorations), beside no-spec and static chains, stepped round robin (session17_ab/ab.py's harness).

    python benchmarks/results/adaptive/session19_probe/ab_forced.py --arm 1 --concurrency 32,16 \
        --static-steps 1,2 --output-file X.json
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "session17_ab"))
from ab import run_ab  # noqa: E402

ARM = int(sys.argv[sys.argv.index("--arm") + 1]) if "--arm" in sys.argv else 1
if "--arm" in sys.argv:
    i = sys.argv.index("--arm")
    del sys.argv[i:i + 2]


def held(llm) -> None:
    llm.engine.drafter.controller.forced_arm = ARM


if __name__ == "__main__":
    run_ab(f"adaptive_k{ARM}", held, "adaptive_forced_arm_ab")
