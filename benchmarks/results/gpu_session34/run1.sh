#!/bin/bash
# Session 34, after staging: the GPU tests, then one request with a tree's next verify launched before
# the sync (default) against after it (+nopresync), same run.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py tests/test_tree_device.py \
    > $OUT/r/gpu_tests.log 2>&1; tail -3 $OUT/r/gpu_tests.log
timeout 60 python3 -m pytest -q -x tests/test_triton_attention.py > $OUT/r/triton_tests.log 2>&1; tail -2 $OUT/r/triton_tests.log
timeout 300 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 20 --natural-stops \
    --configs nospec,chain3,chain5,tree,tree+nopresync,tree32,tree32+nopresync,tree7x32 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_presync.json > $OUT/r/c1_presync.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/c1_presync.log | cut -c1-200
