#!/bin/bash
# Session 35, after staging (the session's first commit's parent in /tmp/old35): exact trees as the
# kernel's EXACT variant only (tree steps replay graphs captured with it; every other step launches
# the plain kernel as before). GPU tests (tiny model); greedy parity of tree 5x4x32 vs no-spec (50
# prompts x 128 tokens, bf16 and fp32); C = 1 with exact trees and shared tiles (SPECSERVE_EXACT_TREES=0);
# the 8B decode against the previous kernel, interleaved. Results in one archive.
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p $R
timeout 150 python3 -m pytest -q -x -m gpu tests/test_draft_graph.py tests/test_gpu_graphs.py > $R/gpu_tests.log 2>&1; tail -n 2 $R/gpu_tests.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 4 --configs nospec,tree32 \
    --parity-config tree32 --parity-prompts 50 --output-file $R/tree_parity.json > $R/tree_parity.log 2>&1
grep -E "parity|Error|error" $R/tree_parity.log | cut -c1-200
for v in exact shared; do
  if [ $v = shared ]; then export SPECSERVE_EXACT_TREES=0; fi
  timeout 150 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
      --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity \
      --output-file $R/c1_$v.json > $R/c1_$v.log 2>&1
  echo "== $v"; grep -E "^(nospec|chain3|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $R/c1_$v.log | cut -c1-110
done
unset SPECSERVE_EXACT_TREES
for run in new_a old_a new_b old_b; do
  pp=$PWD; [ ${run%_*} = old ] && pp=/tmp/old35
  PYTHONPATH=/tmp/site:$pp timeout 100 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,32 \
      --out $R/decode8b_$run.json > $R/decode8b_$run.log 2>&1
  echo "== 8B $run"; grep -vE "^\{" $R/decode8b_$run.log | grep -iE "^ *[0-9]|error" | head -4 | cut -c1-120
done
tar -C $OUT -czf $OUT/run3.tgz r && rm -rf $R
