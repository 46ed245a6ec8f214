#!/bin/bash
# Session 34, after staging: larger and wider trees at one request (the cycle is device-bound; the
# verify costs the same up to 64 tokens), 50 prompts, natural stops.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 500 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
    --configs nospec,chain3,tree32,tree48,tree64,tree5x6x32,tree5x6x48,tree5x8x64 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_wide.json > $OUT/r/c1_wide.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/c1_wide.log | cut -c1-120
