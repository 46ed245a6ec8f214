#!/bin/bash
# Session 28, third call: the sliced sweep (engines interleaved in 0.5-s slices) with an A/B of early_verify.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit3.txt; git status --short >> $OUT/r/commit3.txt
timeout 560 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 3,5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 12 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --log-cycles --slice-s 0.5 --variant noearly:early_verify=False \
    --output-dir $OUT/r/sliced_early > $OUT/r/sliced_early.log 2>&1
tail -30 $OUT/r/sliced_early.log
