"""Start-up: a fast `--help` that describes every flag with its default, speculation on by default for
`serve` and `generate` alike, default CPU threads, and the cost profile reused across starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from specserve.cli import build_parser
from specserve.config import DEFAULT_HEAD
from specserve.engine import threads
from specserve.engine.args import engine_config_from_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_imports_neither_torch_nor_the_server() -> None:
    code = ("import sys, contextlib, io\n"
            "from specserve.cli import main\n"
            "for argv in (['--help'], ['serve', '--help'], ['generate', '--help']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        main(argv)\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'zmq') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO}, check=True).stdout
    assert out.strip() == "[]"


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser([name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_a_description_and_its_default(command: str) -> None:
    p = _subparser(command)
    formatter = p._get_formatter()
    for action in p._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        assert action.help, f"{action.option_strings} has no description"
        text = formatter._expand_help(action)
        assert "default" in text, f"{action.option_strings}: no default in {text!r}"
    assert "speculates by default" in p.description


def test_serve_and_generate_speculate_by_default_with_the_shipped_head() -> None:
    for command in ("serve", "generate"):
        parse = _subparser(command).parse_args
        default = engine_config_from_args(parse([]))
        if (DEFAULT_HEAD / "config.json").exists():
            assert default.speculative is not None and default.speculative.algorithm == "EAGLE3"
        assert engine_config_from_args(parse(["--speculative-algorithm", "NONE"])).speculative is None
        assert engine_config_from_args(parse(["--model", "/some/other.gguf"])).speculative is None


def test_default_threads_are_physical_cores_less_the_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    cores = threads.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert threads.default_num_threads(0, busy=0) == cores
    assert threads.default_num_threads(1, busy=0) == max(1, cores - 1)
    assert threads.default_num_threads(0, busy=1) == max(1, cores - 1)  # a busy neighbour: one core less
    assert threads.default_num_threads(10_000, busy=0) == 1 == threads.default_num_threads(0, busy=10_000)
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert threads.set_cpu_threads(reserved=10_000) == 1 == torch.get_num_threads()
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice is kept
        torch.set_num_threads(min(2, cores))
        assert threads.set_cpu_threads(reserved=10_000) == min(2, cores)
    finally:
        torch.set_num_threads(before)


def test_a_profile_taken_on_a_busy_machine_is_cached_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Every start profiled again when the machine was busy (such a profile was not cached); it is now,
    and the stale check removes it once steps disprove it."""
    from types import SimpleNamespace

    from specserve.speculative import profile
    from specserve.speculative.policy.cost_model import CostModel, Curve

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile, "cost_profile_key", lambda *a: "key")
    taken = []

    def fake_profile(d):
        taken.append(1)
        cost = CostModel(target=Curve({1: 0.01, 8: 0.02}))
        cost.meta = {"noisy": True, "seconds": 1.0, "rechecked": {}, "date": "today"}
        return cost

    monkeypatch.setattr(profile, "profile_costs", fake_profile)
    d = SimpleNamespace(engine=None, head=SimpleNamespace(config=None), runner=SimpleNamespace(graphs=None),
                        cfg=SimpleNamespace(resolved_num_draft_tokens=4, recalibrate=False))
    load = getattr(profile.load_or_profile_costs, "__wrapped__", profile.load_or_profile_costs)  # (conftest's)
    first, path = load(d)
    second, path2 = load(d)
    assert taken == [1] and path == path2 and os.path.exists(path)
    assert second.target.profile == first.target.profile and second.meta["source"].startswith("cache")
    d.cfg.recalibrate = True  # --speculative-recalibrate profiles again
    load(d)
    assert taken == [1, 1]
    assert json.load(open(path))  # a readable cache file


def test_packed_row_threshold_is_measured_once_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The fp32 packed-row threshold is part of the cost profile's key: timed at every start, a busy
    machine got another value (and so a new key, and a new profile) at each start."""
    import torch

    from specserve.models import cpu_packing

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_packing, "_MIN_ROWS", {})
    rows = cpu_packing.packed_min_rows(torch.float32)
    table = json.load(open(tmp_path / "cpu_packing_min_rows.json"))
    assert list(table.values()) == [rows]
    key = next(iter(table))
    json.dump({key: 7}, open(tmp_path / "cpu_packing_min_rows.json", "w"))  # not a value it could measure
    monkeypatch.setattr(cpu_packing, "_MIN_ROWS", {})
    assert cpu_packing.packed_min_rows(torch.float32) == 7  # the next process reads it
