#!/bin/bash
# Session 38, after the bandit's nested tokens (40870a4): the adaptive sweep on the H200 (#8: adaptive >= 0.97 x
# the best of no-spec and static at C = 1, 4, 16, 64, 256), every engine in one process, interleaved in 0.5-s
# slices, 16-s points. $1: the concurrencies, $2: the output folder, $3: more arguments (an A/B beside it:
# --variant old:bandit.nested_tokens=False).
export PYTHONPATH=/tmp/site:$PWD
time timeout 580 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency $1 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 16 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --output-dir $OUT/$2 $3 2>&1 | tail -30
