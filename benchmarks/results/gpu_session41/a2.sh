#!/bin/bash
# Session 41, call 2: the Triton kernels' tests (fp8 K/V stores rounded by the fused rotary kernel: unchecked
# by the CPU's interpreter), then the 8B-shaped decode against the linear-layers floor over a bf16 and an fp8
# K/V cache (d1.sh of session 40). $OUT/tests2.txt, $OUT/gpu_decode.json
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session41/TREE)" | tee $OUT/tests2.txt
timeout 150 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py 2>&1 | tail -4 | tee -a $OUT/tests2.txt
time timeout 420 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,16,128 --also-kv-cache-dtype fp8 \
    --out $OUT/gpu_decode.json 2>&1 | tail -40
