#!/bin/bash
# Session 28, first measuring call on the H200 (after benchmarks/gpu_stage.sh left /tmp/m.gguf).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit.txt
git status --short >> $OUT/r/commit.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests.log 2>&1
tail -3 $OUT/r/gpu_tests.log
timeout 330 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1,4 \
    --configs nospec,static_chain5,static_chain5+noearly,adaptive,adaptive+noearly --output-len 128 \
    --requests-per-c 6 --output-file $OUT/r/bd.json > $OUT/r/bd.log 2>&1
tail -25 $OUT/r/bd.log
