#!/bin/bash
# Session 33, after staging: where a one-request tree cycle's host time goes (cProfile and torch.profiler of
# static_tree beside static_chain5 and no-spec at one request), then the sweep with fuse_full again (run_next.sh 3).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 200 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1 --configs nospec,static_chain5,static_tree \
    --output-len 128 --requests-per-c 8 --length-spread 0 --profile --output-file $OUT/r/bd1.json > $OUT/r/bd1.log 2>&1
tail -6 $OUT/r/bd1.log | cut -c1-1500
