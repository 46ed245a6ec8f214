#!/bin/bash
# The head's rotary + KV write as one kernel, silu_mul / add_rms_norm / one-gather draft ids in the head
# (session 29): GPU tests, one request interleaved A/B (+norope: the head's rotary by torch ops), breakdown,
# and the sliced adaptive sweep.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit2.txt; git status --short >> $OUT/r/commit2.txt
timeout 200 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests2.log 2>&1
tail -3 $OUT/r/gpu_tests2.log
timeout 100 python3 -m pytest -q tests/test_triton_ops.py > $OUT/r/triton_ops2.log 2>&1
tail -2 $OUT/r/triton_ops2.log
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 \
    --configs nospec,chain3,chain5,chain5+norope --parity-prompts 20 --skip-fp32-parity \
    --output-file $OUT/r/c1_rope.json > $OUT/r/c1_rope.log 2>&1
grep -E "^(nospec|chain3|chain5|chain5\+norope):|parity|Error|error" $OUT/r/c1_rope.log | cut -c1-300
timeout 120 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1,4 \
    --configs nospec,static_chain5,static_chain5+norope,adaptive --output-len 128 --requests-per-c 6 \
    --output-file $OUT/r/bd_rope.json > $OUT/r/bd_rope.log 2>&1
grep "^C=" $OUT/r/bd_rope.log | cut -c1-70
timeout 280 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 12 --threshold-n 0 \
    --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --output-dir $OUT/r/sweep > $OUT/r/sweep.log 2>&1
tail -12 $OUT/r/sweep.log | cut -c1-200
