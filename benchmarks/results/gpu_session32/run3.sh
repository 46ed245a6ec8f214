#!/bin/bash
# Session 32's third GPU call (after staging): fuse_full (every full decision before the sync, explorations'
# first cycles too) beside the default, now that an early full decision is the one applied (session 27 and 31
# measured fuse_full while draft_step replaced most early decisions with a quick one).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 280 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant full:fuse_full=True --log-cycles \
    --output-dir /tmp/sweep3 > $OUT/r/sweep3.log 2>&1
tar czf $OUT/r/sweep3.tgz -C /tmp sweep3
grep -E "^C=" $OUT/r/sweep3.log | cut -c1-250
