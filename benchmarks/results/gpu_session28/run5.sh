#!/bin/bash
# Session 28, fifth call: GPU tests and the one-request figures after the draft loop's kernel trim.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit5.txt; git status --short >> $OUT/r/commit5.txt
timeout 150 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests5.log 2>&1
tail -2 $OUT/r/gpu_tests5.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 \
    --configs nospec,chain3,chain5 --parity-prompts 20 --skip-fp32-parity \
    --output-file $OUT/r/c1_trim.json > $OUT/r/c1_trim.log 2>&1
grep -E "^(nospec|chain3|chain5):|parity" $OUT/r/c1_trim.log
timeout 150 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1,4 \
    --configs nospec,static_chain5,adaptive --output-len 128 --requests-per-c 6 \
    --output-file $OUT/r/bd_trim.json > $OUT/r/bd_trim.log 2>&1
grep "^C=" $OUT/r/bd_trim.log | cut -c1-60
