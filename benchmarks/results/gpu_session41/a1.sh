#!/bin/bash
# Session 41, call 1: what overlap scheduling buys plain decoding on the H200 (host_overhead's tiny random
# model: a step is host and launch time; nospec / spec_off / adaptive_forced0 = auto = overlapped on CUDA), then the GPU graph tests
# (graphs with an fp8 cache, overlap scheduling through graphs; the kernels' tests are in a2.sh).
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/tests.txt
echo "tree $(cat benchmarks/results/gpu_session41/TREE)" | tee -a $OUT/tests.txt
for c in 64 256; do
  timeout 150 python3 benchmarks/host_overhead.py --device cuda --concurrency $c --requests $((c * 4)) --rounds 3 \
      --configs nospec_sync,nospec,spec_off_sync,spec_off,adaptive_forced0 --output-file $OUT/ho$c.json 2>&1 | grep -E "ms/step|Error|error" | tail -6
done
timeout 230 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py -k "not smollm2_chat" -s \
    -p no:cacheprovider 2>&1 | grep -E "fp8 vs|passed|failed|Error|error|^FAILED" | tail -15 | tee -a $OUT/tests.txt
