#!/bin/bash
# Session 36, after staging (benchmarks/gpu_stage.sh): exact trees at 62218cc. Parity of tree 5x4x32 vs
# no-spec (bf16 and fp32, 50 prompts x 128 tokens) for exact and exact + shared prefix; C = 1 speed for
# exact, exact + shared prefix and shared tiles, each in its own process. Results in one archive.
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
time bash benchmarks/gpu_exact_trees.sh $R
tar -C $OUT -czf $OUT/run1.tgz r && rm -rf $R
