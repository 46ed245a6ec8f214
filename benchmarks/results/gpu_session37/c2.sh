#!/bin/bash
# Session 37: parity (tree 5x4x32 vs no-spec, 50 prompts x 128 tokens, bf16 and fp32) and C = 1 per attention
# mode (gpu_exact_trees.sh), then the 8B-shaped decode against its linear-layers floor and the verify curve.
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r2; mkdir -p $R
time bash benchmarks/gpu_exact_trees.sh $R "prefix exact shared"
timeout 150 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --out $R/gpu_decode.json 2>&1 | tail -25 | tee $R/gpu_decode.log
