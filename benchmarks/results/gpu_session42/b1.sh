#!/bin/bash
# Session 42, call 1 (no GGUF): the 8B-shaped decode against its linear-layers floor over a bf16 and an fp8
# K/V cache (session 41's a2.sh), the Triton kernels' tests (fp8 stores rounded on the GPU), and the overlap
# scheduling GPU tests over the fixed read-back (a3.sh's tests). $OUT/gpu_decode.json, $OUT/tests.txt
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session42/TREE)" | tee $OUT/tests.txt
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee -a $OUT/tests.txt
time timeout 330 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,16,128 --also-kv-cache-dtype fp8 \
    --out $OUT/gpu_decode.json 2>&1 | tail -40
timeout 120 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/tests.txt
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -k "overlap" -p no:cacheprovider 2>&1 | tail -3 | tee -a $OUT/tests.txt
