#!/bin/bash
# Session 33, after staging: the host-time changes (one tree's inputs by slices, slot padding refilled only
# where needed): the tiny model's one-request cycle again, the GPU tests, then SmolLM2 at one request.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
bash benchmarks/results/gpu_session33/run3.sh after
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests_after.log 2>&1
tail -2 $OUT/r/gpu_tests_after.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 20 --natural-stops \
    --configs nospec,chain3,chain5,tree,tree32,tree7x32 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_after.json > $OUT/r/c1_after.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity|Error" $OUT/r/c1_after.log | cut -c1-130
