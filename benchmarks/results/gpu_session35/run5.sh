#!/bin/bash
# Session 35, after staging: run4's shared ranges below the tree, with the tree's lowest key taken q
# keys lower where the step is planned longer and moved back on the device (run4: 42/50 in bf16, the
# verify launched before the sync shared a range that held tree keys). Greedy parity of tree 5x4x32 vs
# no-spec in bf16 (50 prompts x 128 tokens); C = 1 with exact trees (the last of the device budget).
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 4 --configs nospec,chain3,tree32 \
    --parity-config tree32 --parity-prompts 50 --skip-fp32-parity --output-file $OUT/tree_parity.json > $OUT/tree_parity.log 2>&1
grep -E "parity|Error|error" $OUT/tree_parity.log | cut -c1-200
timeout 100 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
    --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity --output-file $OUT/c1_exact.json > $OUT/c1_exact.log 2>&1
grep -E "^(nospec|chain3|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/c1_exact.log | cut -c1-110
