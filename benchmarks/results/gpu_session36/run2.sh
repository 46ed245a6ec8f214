#!/bin/bash
# Session 36: the target's attention alone for a one-request verify (benchmarks/gpu_tree_attention.py):
# decode / shared tiles / exact / exact + shared prefix at 100..2000 keys, this tree's kernel (path
# positions over all 64 bits at once) beside 62218cc's (a 64-step loop), interleaved. Then the tree
# attention tests on the H200 (bf16 included). No GGUF needed. The second module was 62218cc's backend,
# carried as an untracked copy: git show 62218cc:specserve/attention/triton_backend.py > <that path>.
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
timeout 240 python3 benchmarks/gpu_tree_attention.py --seq-lens 100,500,1000,2000 \
    --module benchmarks/results/gpu_session36/triton_backend_62218cc.py --output-file $R/tree_attention.json 2>&1 | tee $R/tree_attention.log | grep -v "^wrote"
timeout 300 python3 -m pytest -q -x tests/test_triton_attention.py -k "tree" 2>&1 | tail -3 | tee $R/pytest_tree.log
tar -C $OUT -czf $OUT/run2.tgz r && rm -rf $R
