#!/bin/bash
# Session 34, after staging: is the tree lossless on the H200? Greedy parity of tree 5x4x32 against no-spec,
# 30 prompts x 128 tokens, in bf16 (the timed engines) and fp32 (new engines); where they diverge.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 500 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 4 --configs nospec,tree32 \
    --parity-config tree32 --parity-prompts 30 --output-file $OUT/r/tree_parity.json > $OUT/r/tree_parity.log 2>&1
grep -E "^(nospec|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/tree_parity.log | cut -c1-160
