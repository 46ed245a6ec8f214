#!/bin/bash
# Session 40: GPU tests of sessions 39-40 (the drafter's unpaid catch-up, the fp8 K/V cache: the fused
# rotary kernel's rounded fp8 stores and graphs with an fp8 cache are checked on a GPU only). $OUT/tests.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/tests.txt
git_tree=$(cat benchmarks/results/gpu_session40/TREE 2>/dev/null); echo "tree $git_tree" >> $OUT/tests.txt
timeout 200 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py 2>&1 | tail -8 | tee -a $OUT/tests.txt
timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py -k "not smollm2_chat" -s \
    -p no:cacheprovider 2>&1 | grep -E "fp8 vs|passed|failed|Error|error|^FAILED" | tail -15 | tee -a $OUT/tests.txt
