#!/bin/bash
# Session 31, third call (at a7bc8d2 + gpu_graph_parts --kernels): fuse_full and fuse_exploit against the
# adaptive engine as it was, each engine's cycles logged; the kernels of each one-request graph
export PYTHONPATH=/tmp/site:$PWD; mkdir -p $OUT/r
timeout 380 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant full:fuse_full=True --variant lean:fuse_exploit=True --log-cycles --output-dir /tmp/sweep_ab > $OUT/r/sweep_ab.log 2>&1
tar czf $OUT/r/sweep_ab.tgz -C /tmp sweep_ab
timeout 120 python3 benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs chain5,tree --kernels --output-file $OUT/r/parts_k.json > $OUT/r/parts_k.log 2>&1
