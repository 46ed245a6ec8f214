#!/bin/bash
# Session 40: the 8B-shaped decode against the linear-layers floor, then decode again over an fp8 K/V cache
# (a second runner on the same model, the floor measured alongside). $OUT/gpu_decode.json
export PYTHONPATH=/tmp/site:$PWD
time timeout 560 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,16,128 --also-kv-cache-dtype fp8 \
    --out $OUT/gpu_decode.json 2>&1 | tail -40
