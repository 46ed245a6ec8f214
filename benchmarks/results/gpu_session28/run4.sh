#!/bin/bash
# Session 28, fourth call: where the host's time goes in a chain-5 cycle at one request (finer wraps).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit4.txt; git status --short >> $OUT/r/commit4.txt
timeout 200 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1 \
    --configs nospec,static_chain5,static_chain5+noearly --output-len 128 --requests-per-c 6 \
    --output-file $OUT/r/bd_parts.json > $OUT/r/bd_parts.log 2>&1
grep "^C=" $OUT/r/bd_parts.log | tr '|,' '\n\n'
