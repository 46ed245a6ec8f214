#!/bin/bash
# Session 42, after staging the GGUF: C = 1 speculation only (b2.sh's first half: no-spec overlap scheduled now).
# $1: the last staging part's directory (staged first). $OUT/c1.json, $OUT/c1.log
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 18 | tail -1
echo "tree $(cat benchmarks/results/gpu_session42/TREE)"
timeout 240 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
    --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity --output-file $OUT/c1.json > $OUT/c1.log 2>&1
grep -E "^(nospec|chain3|tree32):.*tok/s|^parity|Error|error" $OUT/c1.log | cut -c1-140
