#!/bin/bash
# Session 39 (for the next lease): the adaptive sweep on the H200 (#8: adaptive >= 0.97 x the best of no-spec
# and static at C = 1, 4, 16, 64, 256), every engine in one process, interleaved in 0.5-s slices, with an
# adaptive engine held at depth 5 beside it (its machinery without its choices: sweep_b ran ~10 % under
# chain 5 at one request at the same depth and paths, sweep_a's held engine was level) and every adaptive
# engine's cycles logged (benchmarks/cycle_log.py: per bucket and arm the bandit's measure against the
# engine's own time, explorations apart; at 256 requests sweep_b's bandit put depth 5 at 28,600 tok/s where
# static chain 5 made 22,700 and plain decoding 29,100 where no-spec made 26,300).
# $1: the concurrencies, $2: the output folder, $3: more arguments.
export PYTHONPATH=/tmp/site:$PWD
time timeout 580 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency $1 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 14 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant held5:forced_arm=5 --log-cycles \
    --output-dir $OUT/$2 $3 2>&1 | tail -30
