#!/bin/bash
# Session 31: topk_logprobs (one kernel per tree depth), fused launches near a request's end,
# fuse_exploit on by default (A/B against it off), GPU tests incl. the new kernel's
export PYTHONPATH=/tmp/site:$PWD; mkdir -p $OUT/r
git log --oneline -1 > $OUT/r/commit.txt 2>/dev/null
timeout 120 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests.log 2>&1
tail -2 $OUT/r/gpu_tests.log
timeout 60 python3 -m pytest -q tests/test_triton_ops.py tests/test_tree_device.py > $OUT/r/gpu_tests2.log 2>&1
tail -1 $OUT/r/gpu_tests2.log
timeout 100 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops --configs nospec,chain3,chain5,tree,tree12 --parity-prompts 10 --skip-fp32-parity --output-file $OUT/r/c1.json > $OUT/r/c1.log 2>&1
grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity" $OUT/r/c1.log | cut -c1-110
timeout 50 python3 benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs tree --kernels --output-file $OUT/r/parts_k.json > $OUT/r/parts_k.log 2>&1
grep -E "launches" $OUT/r/parts_k.log
timeout 250 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant noexploit:fuse_exploit=False --log-cycles --output-dir /tmp/sweep3 > $OUT/r/sweep3.log 2>&1
tar czf $OUT/r/sweep3.tgz -C /tmp sweep3
grep -E "^C=" $OUT/r/sweep3.log | cut -c1-220
