#!/bin/bash
# Session 30: one request, configurations alternating per prompt, natural stops: chains against trees with the
# fused launch (and the tree without it: +nofused).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 420 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
    --configs nospec,chain3,chain5,tree,tree+nofused,tree8,tree12 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_tree.json > $OUT/r/c1_tree.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):|parity|Error|error|fallback" $OUT/r/c1_tree.log | cut -c1-220
tail -3 $OUT/r/c1_tree.log | cut -c1-300
