#!/bin/bash
# Session 30: the tree expansion through lanes (decode attention per frontier slot). GPU tests; one request,
# natural stops, chains against trees; device time per graph.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit4.txt; git status --short >> $OUT/r/commit4.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests4.log 2>&1
tail -4 $OUT/r/gpu_tests4.log | cut -c1-300
timeout 100 python3 -m pytest -q tests/test_tree_device.py tests/test_triton_ops.py tests/test_draft_graph_triton.py > $OUT/r/triton_ops4.log 2>&1
tail -2 $OUT/r/triton_ops4.log | cut -c1-300
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
    --configs nospec,chain3,chain5,tree,tree8,tree12,tree6x10 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_lanes.json > $OUT/r/c1_lanes.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):|parity|Error|error|fallback" $OUT/r/c1_lanes.log | cut -c1-200
timeout 100 python3 benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs chain5,tree \
    --output-file $OUT/r/parts4.json > $OUT/r/parts4.log 2>&1
grep -v Warning $OUT/r/parts4.log | cut -c1-700
