#!/bin/bash
# For branch exact-path-table (session 36; not run: no device lent after run 2), after staging: exact trees
# reading their paths from a table built once a step (_path_table_kernel) in one key loop, the ranges
# below the tree shared by default. 1) the attention alone beside 62218cc's kernel (gpu_tree_attention.py);
# 2) the attention tests and the GPU graph tests on the H200; 3) parity and C = 1 per mode
# (gpu_exact_trees.sh: exact + shared prefix (default), exact, shared tiles). Merge the branch if 1) shows
# the exact rows near shared tiles' at 100 keys, 2) passes and 3) holds 50/50.
# (62218cc's backend, the baseline: git show 62218cc:specserve/attention/triton_backend.py > benchmarks/results/gpu_session36/triton_backend_62218cc.py)
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
timeout 200 python3 benchmarks/gpu_tree_attention.py --seq-lens 100,300,500,1000,2000 \
    --module benchmarks/results/gpu_session36/triton_backend_62218cc.py --output-file $R/tree_attention.json 2>&1 | tee $R/tree_attention.log | grep -v "^wrote"
timeout 200 python3 -m pytest -q -x tests/test_triton_attention.py -k "tree" 2>&1 | tail -3 | tee $R/pytest_tree.log
timeout 200 python3 -m pytest -q -x -m gpu tests/test_draft_graph.py tests/test_gpu_graphs.py 2>&1 | tail -3 | tee $R/pytest_gpu.log
time bash benchmarks/gpu_exact_trees.sh $R "prefix exact shared"
tar -C $OUT -czf $OUT/run3.tgz r && rm -rf $R
