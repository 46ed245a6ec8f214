#!/bin/bash
# Session 29, at 22ac7f3: the sliced sweep at 1, 4, 16, 64 and 256 requests (session 28's command).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 560 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16,64,256 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 12 --threshold-n 0 \
    --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --output-dir /tmp/sweep4 > $OUT/r/sweep4.log 2>&1
tar czf $OUT/r/sweep4.tgz -C /tmp sweep4
tail -14 $OUT/r/sweep4.log | cut -c1-220
