"""Load-adaptive speculation vs. no speculation, static speculation and the batch threshold.

One sweep (every configuration served by `specserve serve`, loaded over HTTP with ShareGPT
prompts) over concurrency C, then a ramp of C over time for no-spec and adaptive. Writes JSON,
PNG plots and markdown tables into --output-dir (default benchmarks/results/adaptive).

    .venv/bin/python benchmarks/adaptive.py [--concurrency 1,2,4,8,16,32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CONFIGS = {
    "none": "--speculative-algorithm NONE",
    "static-chain1": "--speculative-algorithm EAGLE3 --speculative-policy static --speculative-num-steps 1",
    "static-chain3": "--speculative-algorithm EAGLE3 --speculative-policy static --speculative-num-steps 3",
    "threshold4": "--speculative-algorithm EAGLE3 --speculative-policy threshold "
                  "--speculative-disable-batch-threshold 4 --speculative-num-steps 3",
    "adaptive": "--speculative-algorithm EAGLE3 --speculative-policy adaptive --speculative-num-steps 3",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--prompts-per-concurrency", type=int, default=2)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--max-prompts", type=int, default=64)
    ap.add_argument("--ramp", default="1,32,1")
    ap.add_argument("--ramp-step-duration", type=float, default=20)
    ap.add_argument("--output-dir", default="benchmarks/results/adaptive")
    ap.add_argument("--skip-ramp", action="store_true")
    args = ap.parse_args()
    base = [sys.executable, "-m", "specserve.cli", "bench", "sweep", "--dataset", "sharegpt",
            "--sharegpt-output-len", str(args.output_len), "--sharegpt-max-input-len", str(args.max_input_len),
            "--ignore-eos", "--seed", "0", "--server-env", "OMP_NUM_THREADS=2", "--warmup-requests", "2",
            "--disable-tqdm"]
    sweep = base + [x for name, flags in CONFIGS.items() for x in ("--config", f"{name}={flags}")] + [
        "--concurrency", args.concurrency, "--prompts-per-concurrency", str(args.prompts_per_concurrency),
        "--min-prompts", str(args.min_prompts), "--max-prompts", str(args.max_prompts),
        "--output-dir", os.path.join(args.output_dir, "sweep")]
    subprocess.run(sweep, check=True)
    if not args.skip_ramp:
        ramp = base + ["--config", f"none={CONFIGS['none']}", "--config", f"adaptive={CONFIGS['adaptive']}",
                       "--ramp", args.ramp, "--ramp-doubling", "--ramp-step-duration", str(args.ramp_step_duration),
                       "--output-dir", os.path.join(args.output_dir, "ramp")]
        subprocess.run(ramp, check=True)


if __name__ == "__main__":
    main()
