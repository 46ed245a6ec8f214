#!/bin/bash
# Session 41, last call (little device time left): a3.sh's first half, 64 requests only.
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session41/TREE)"
timeout 115 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency 64 --requests 192 \
    --rounds 2 --configs nospec_sync,nospec,spec_off,adaptive_forced0 --output-file $OUT/ho64.json 2>&1 \
    | grep -E "ms/step|Error|error" | tail -6
