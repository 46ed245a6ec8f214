#!/bin/bash
# Session 33, after staging: deeper trees at one request (the cycle is host-bound there, so tokens per verify pay).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 300 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 20 --natural-stops \
    --configs nospec,chain3,tree,tree32,tree6x32,tree7x32,tree7x48,tree8x64 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_deep.json > $OUT/r/c1_deep.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/c1_deep.log | cut -c1-160
