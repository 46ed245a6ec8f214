#!/bin/bash
# Session 34, after staging: the tree's verify before the sync as its own graph (TreeVerifyGraph) and the
# features kept in the fused launch; GPU tests, then one request (50 prompts) with it (default) and
# without the presync launch, and the host's wait per cycle.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py \
    > $OUT/r/gpu_tests4.log 2>&1; tail -2 $OUT/r/gpu_tests4.log
timeout 300 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
    --configs nospec,chain3,tree32,tree32+nopresync,tree5x6x32 --parity-prompts 10 --skip-fp32-parity \
    --output-file $OUT/r/c1_vgraph.json > $OUT/r/c1_vgraph.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity|Error|error" $OUT/r/c1_vgraph.log | cut -c1-150
timeout 100 python3 benchmarks/results/gpu_session34/probe_host_wait.py 2>&1 | grep "steps" 
