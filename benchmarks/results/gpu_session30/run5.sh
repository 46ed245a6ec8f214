#!/bin/bash
# Session 30, at 88d0f28: the calls made by hand after run4 on the same lease.
# (a) part 1 restaged (run4's first staging call was refused) and run4's two benchmarks again -> r4/c1_lanes.*, r4/parts4.*
# (b) session 29's run5.sh (b): the adaptive engine against itself held at depth 5 -> r5/
# (c) the same at chain 5 only; its first --variant (full:fuse_full=True) was silently dropped by argparse (only the
#     last one ran; adaptive.py now refuses a second --variant) -> r6/
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 280 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4 --static-steps 3,5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant forced5:forced_arm=5 --output-dir /tmp/sweep5 > $OUT/r/sweep5.log 2>&1
tar czf $OUT/r/sweep5.tgz -C /tmp sweep5
timeout 200 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4 --static-steps 5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant forced5:forced_arm=5 --output-dir /tmp/sweep6 > $OUT/r/sweep6.log 2>&1
tar czf $OUT/r/sweep6.tgz -C /tmp sweep6
