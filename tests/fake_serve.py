"""`specserve serve` around the fake engine (fake_engine.py), for lifecycle tests that need a real process
tree (supervisor, engine core, front-ends) and real signals, without a model's start-up time."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from specserve.server.args import add_serve_args  # noqa: E402
from specserve.server.launch import run_server  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    parser.add_argument("--step-delay", type=float, default=0.01)
    args = parser.parse_args()
    factory = partial(FakeEngine, step_delay=args.step_delay, max_model_len=4096, num_blocks=4096, max_num_seqs=64)
    sys.exit(run_server(args, factory))
