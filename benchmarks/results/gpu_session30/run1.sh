#!/bin/bash
# Session 30: trees selected on the device, the tree's fused launch (acceptance, catch-up, expansion, selection as
# one graph) and its early verify. GPU tests, then Triton/CUDA unit tests.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit1.txt; git status --short >> $OUT/r/commit1.txt
timeout 330 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests1.log 2>&1
tail -15 $OUT/r/gpu_tests1.log | cut -c1-300
timeout 150 python3 -m pytest -q tests/test_tree_device.py tests/test_triton_ops.py tests/test_draft_graph_triton.py > $OUT/r/triton_ops1.log 2>&1
tail -3 $OUT/r/triton_ops1.log | cut -c1-300
