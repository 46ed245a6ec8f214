#!/bin/bash
# Session 41, call 1: the GPU graph tests (graphs with an fp8 cache; overlap scheduling through graphs, plain
# and in a spec engine), then what overlap scheduling buys on the H200: host_overhead over SmolLM2's shapes
# with random weights (--dummy-smollm2: a real step's device time; nospec / spec_off / adaptive_forced0 are
# overlapped on CUDA by default, nospec_sync is not). $OUT/tests.txt, $OUT/ho<C>.json
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/tests.txt
echo "tree $(cat benchmarks/results/gpu_session41/TREE)" | tee -a $OUT/tests.txt
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py -k "not smollm2_chat" -s \
    -p no:cacheprovider 2>&1 | grep -E "fp8 vs|passed|failed|Error|error|^FAILED" | tail -15 | tee -a $OUT/tests.txt
for c in 64 256; do
  timeout 150 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $c --requests $((c * 3)) \
      --rounds 2 --configs nospec_sync,nospec,spec_off,adaptive_forced0 --output-file $OUT/ho$c.json 2>&1 \
      | grep -E "ms/step|Error|error" | tail -6
done
