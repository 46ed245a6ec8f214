#!/bin/bash
# Session 35, after staging: exact trees with the key ranges below the tree shared by tiles of several
# tokens (each token merges its own partial outputs), the ranges holding the tree per token. Greedy
# parity of tree 5x4x32 vs no-spec in bf16 (50 prompts x 128 tokens); C = 1 with exact trees and with
# shared tiles (SPECSERVE_EXACT_TREES=0). Results in one archive.
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
timeout 120 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 4 --configs nospec,tree32 \
    --parity-config tree32 --parity-prompts 50 --skip-fp32-parity --output-file $R/tree_parity.json > $R/tree_parity.log 2>&1
grep -E "parity|Error|error" $R/tree_parity.log | cut -c1-200
for v in exact shared; do
  if [ $v = shared ]; then export SPECSERVE_EXACT_TREES=0; fi
  timeout 120 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
      --configs nospec,tree32 --parity-prompts 10 --skip-fp32-parity \
      --output-file $R/c1_$v.json > $R/c1_$v.log 2>&1
  echo "== $v"; grep -E "^(nospec|chain3|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $R/c1_$v.log | cut -c1-110
done
tar -C $OUT -czf $OUT/run4.tgz r && rm -rf $R
