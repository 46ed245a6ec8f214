#!/bin/bash
# Session 36 (not run: no device lent after run 2), for branch exact-path-table, after staging: exact
# trees reading their paths from a table built once a step (_path_table_kernel) in one key loop, the
# ranges below the tree shared by default. The attention
# alone beside 62218cc's kernel (gpu_tree_attention.py); the tree attention tests on the H200; then
# parity and C = 1 per mode (gpu_exact_trees.sh: exact + shared prefix (default), exact, shared tiles).
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
timeout 200 python3 benchmarks/gpu_tree_attention.py --seq-lens 100,300,500,1000,2000 \
    --module benchmarks/results/gpu_session36/triton_backend_62218cc.py --output-file $R/tree_attention.json 2>&1 | tee $R/tree_attention.log | grep -v "^wrote"
timeout 200 python3 -m pytest -q -x tests/test_triton_attention.py -k "tree" 2>&1 | tail -3 | tee $R/pytest_tree.log
time bash benchmarks/gpu_exact_trees.sh $R "prefix exact shared"
tar -C $OUT -czf $OUT/run3.tgz r && rm -rf $R
