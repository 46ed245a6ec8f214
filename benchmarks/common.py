"""Helpers shared by the CPU benchmark scripts: run metadata, chat prompts, medians, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from typing import Any, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata() -> dict[str, Any]:
    """Who/where/when: command line, date, versions, thread count, load average at start."""
    import transformers

    return {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_average(),
    }


def chat_prompt_ids(tokenizer: Any, num: int, seed: int = 0, max_chars: int | None = 1200,
                    start: int = 0) -> list[list[int]]:
    """Token ids of ``num`` ShareGPT first turns under the model's chat template (fixed by ``seed``).

    ``start`` skips that many prompts of the same seeded order, so disjoint sets can be drawn.
    """
    from specserve.bench.datasets import sharegpt_prompts

    samples = sharegpt_prompts(start + num, seed=seed, max_chars=max_chars)[start:]
    if len(samples) < num:
        raise ValueError(f"ShareGPT gave {len(samples)} prompts, {num} asked for")
    return [tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True)
            for s in samples]


def median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write_json(path: str, result: dict[str, Any]) -> None:
    result.setdefault("load_average_end", load_average())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
