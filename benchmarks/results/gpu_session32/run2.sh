#!/bin/bash
# Session 32's second GPU call (after staging): the GPU tests, then the adaptive sweep at 1, 4 and 16 requests with the two fixes
# (capped decisions keep the pick; an early full decision is the one draft_step applies) and fuse_explorations
# on, beside it off (nofexp); then one request, natural stops. Every adaptive engine's cycles logged.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 170 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests.log 2>&1
tail -2 $OUT/r/gpu_tests.log
timeout 330 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant nofexp:fuse_explorations=False --log-cycles \
    --output-dir /tmp/sweep2 > $OUT/r/sweep2.log 2>&1
tar czf $OUT/r/sweep2.tgz -C /tmp sweep2
grep -E "^C=" $OUT/r/sweep2.log | cut -c1-250
timeout 150 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
    --configs nospec,chain5,tree --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1.json > $OUT/r/c1.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity" $OUT/r/c1.log | cut -c1-110
