#!/bin/bash
# Session 31, first two calls (at 270ed9f): session 30's run6_next.sh, split in two (what ran: the commands below)
export PYTHONPATH=/tmp/site:$PWD; mkdir -p $OUT/r
timeout 170 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests.log 2>&1
timeout 230 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops --configs nospec,chain3,chain5,tree,tree12 --parity-prompts 10 --skip-fp32-parity --output-file $OUT/r/c1.json > $OUT/r/c1.log 2>&1
timeout 90 python3 benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs chain5,tree --output-file $OUT/r/parts.json > $OUT/r/parts.log 2>&1
# second call
timeout 330 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant full:fuse_full=True --log-cycles --output-dir /tmp/sweep_full > $OUT/r/sweep_full.log 2>&1
tar czf $OUT/r/sweep_full.tgz -C /tmp sweep_full
timeout 180 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1 --configs static_chain5,static_tree --output-len 128 --requests-per-c 6 --profile --output-file $OUT/r/bd_tree.json > $OUT/r/bd_tree.log 2>&1
