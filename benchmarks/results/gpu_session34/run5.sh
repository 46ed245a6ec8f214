#!/bin/bash
# Session 34, after staging: the Triton attention's split-K at one request: default (keys split from 2 x 128)
# against none (SPECSERVE_ATTN_MIN_SPLIT_KEYS=1000000), two processes, 50 prompts each.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
for v in default nosplit; do
  if [ $v = nosplit ]; then export SPECSERVE_ATTN_MIN_SPLIT_KEYS=1000000; fi
  timeout 250 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
      --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity \
      --output-file $OUT/r/c1_split_$v.json > $OUT/r/c1_split_$v.log 2>&1
  echo "== $v"; grep -E "^(nospec|chain3|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/c1_split_$v.log | cut -c1-110
done
