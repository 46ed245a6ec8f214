#!/bin/bash
# Session 42, call 2 (no GGUF): the 8B-shaped decode against its linear-layers floor over a bf16 and an fp8
# K/V cache (session 41's a2.sh), then the Triton kernels' tests (fp8 stores rounded on the GPU).
# $OUT/gpu_decode.json, $OUT/tests.txt
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session42/TREE)" | tee $OUT/tests.txt
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee -a $OUT/tests.txt
time timeout 360 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,16,128 --also-kv-cache-dtype fp8 \
    --out $OUT/gpu_decode.json 2>&1 | tail -40
timeout 120 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/tests.txt
