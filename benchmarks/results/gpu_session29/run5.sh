#!/bin/bash
# Session 29, at 22ac7f3. (a) was run by hand after run4 (natural stops with the tree; run3's call had the
# configs in an order gpu_spec_c1 refuses). (b), NOT RUN (the device refused the first staging call, then the
# session's device time ran out): the sliced sweep at 1 and 4 requests with the adaptive engine
# held at depth 5 (forced_arm: every decision skipped, the bookkeeping kept) beside the adaptive one.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
# (a) timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
#       --configs nospec,chain3,chain5,tree --parity-prompts 10 --skip-fp32-parity --output-file $OUT/r/c1_natural.json
timeout 300 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 \
    --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant forced5:forced_arm=5 \
    --output-dir /tmp/sweep5 > $OUT/r/sweep5.log 2>&1
tar czf $OUT/r/sweep5.tgz -C /tmp sweep5
grep -E "^C=|^\| [0-9]" $OUT/r/sweep5.log | head -4 | cut -c1-250
