#!/bin/bash
# The fused launch as one graph (GPU tests, one request interleaved A/B, breakdown). Written in session 28
# and NOT run there (the device would not start again before its time ran out): the next GPU session's first.
export PYTHONPATH=/tmp/site:$PWD
export SPECSERVE_FUSED_LAUNCH_GRAPH=1  # off by default until measured
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit6.txt; git status --short >> $OUT/r/commit6.txt
timeout 170 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests6.log 2>&1
tail -3 $OUT/r/gpu_tests6.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 \
    --configs nospec,chain3,chain5,chain5+nograph --parity-prompts 20 --skip-fp32-parity \
    --output-file $OUT/r/c1_graph.json > $OUT/r/c1_graph.log 2>&1
grep -E "^(nospec|chain3|chain5|chain5\+nograph):|parity|Error|error" $OUT/r/c1_graph.log | cut -c1-300
timeout 120 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1,4 \
    --configs nospec,static_chain5,static_chain5+nograph,adaptive --output-len 128 --requests-per-c 6 \
    --output-file $OUT/r/bd_graph.json > $OUT/r/bd_graph.log 2>&1
grep "^C=" $OUT/r/bd_graph.log | cut -c1-70
