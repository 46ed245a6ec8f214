#!/bin/bash
# Session 29, at 22ac7f3: the fused launch graph with one host copy and the row-by-row catch-up attention, up to
# four requests. GPU tests; one request interleaved A/B (+nograph: the launch step by step); natural stops with tree.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit3.txt; git status --short >> $OUT/r/commit3.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests3.log 2>&1
tail -3 $OUT/r/gpu_tests3.log
timeout 100 python3 -m pytest -q tests/test_triton_ops.py tests/test_draft_graph_triton.py > $OUT/r/triton_ops3.log 2>&1
tail -2 $OUT/r/triton_ops3.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 \
    --configs nospec,chain3,chain5,chain5+nograph --parity-prompts 20 --skip-fp32-parity \
    --output-file $OUT/r/c1_onecopy.json > $OUT/r/c1_onecopy.log 2>&1
grep -E "^(nospec|chain3|chain5|chain5\+nograph):|parity|Error|error" $OUT/r/c1_onecopy.log | cut -c1-200
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
    --configs nospec,chain5,tree --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_natural.json > $OUT/r/c1_natural.log 2>&1
grep -E "^(nospec|chain5|tree):|parity|Error|error" $OUT/r/c1_natural.log | cut -c1-200
