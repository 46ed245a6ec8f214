"""A/B of the seed displacement (session 16, 5fa4d55), in one run: the adaptive engine as committed
("adaptive": each served cycle displaces one start-up seed) against the same engine whose seeds are
never displaced ("adaptive_kept": they fade like cycles, as before 5fa4d55), beside no-spec and
static chains, stepped round robin like benchmarks/adaptive.py's sweep (its Client, run_point).

    python benchmarks/results/adaptive/session17_ab/ab_seeds.py --concurrency 1,8,1,8 --output-file X.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import run_ab  # noqa: E402  (also puts the repository and benchmarks/ on the path)

from specserve import LLM  # noqa: E402
from specserve.spec.bandit import ArmStats  # noqa: E402


class Kept(ArmStats):
    def displace_seed(self) -> None:
        pass


def kept_seeds(llm: LLM) -> None:
    """The B side: the calibration's seeds (put in while the engine was built) are never displaced."""
    bandit = llm.engine.drafter.controller.bandit
    for arms in bandit.stats.values():
        for st in arms.values():
            st.__class__ = Kept
    orig_observe = bandit.observe

    def observe(key, arm, *a, **kw):  # an arm first seen while serving: Kept too (seeds come later)
        arms = bandit.stats.setdefault(key, {})
        if arm not in arms:
            arms[arm] = Kept()
        return orig_observe(key, arm, *a, **kw)

    bandit.observe = observe


if __name__ == "__main__":
    run_ab("adaptive_kept", kept_seeds, "adaptive_seed_displacement_ab")
