#!/bin/bash
# Session 37, after staging, on branch exact-path-table rebased on main (ept37): the path-table kernel's
# attention alone beside 62218cc's (gpu_tree_attention.py), the tree attention tests, the GPU graph tests.
# The A/B baseline (62218cc's backend) travelled as a file, the device has no git; to recreate it:
#   git show 62218cc:specserve/attention/triton_backend.py > benchmarks/results/gpu_session36/triton_backend_62218cc.py
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r1; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
timeout 200 python3 benchmarks/gpu_tree_attention.py --seq-lens 100,300,500,1000,2000 \
    --module benchmarks/results/gpu_session36/triton_backend_62218cc.py --output-file $R/tree_attention.json 2>&1 | tee $R/tree_attention.log | grep -v "^wrote"
timeout 150 python3 -m pytest -q -x tests/test_triton_attention.py 2>&1 | tail -3 | tee $R/pytest_attention.log
timeout 200 python3 -m pytest -q -x -m gpu tests/test_draft_graph.py tests/test_gpu_graphs.py 2>&1 | tail -3 | tee $R/pytest_gpu.log
