#!/bin/bash
# Session 41, call 3: a1.sh's host_overhead again after the read-back fix (pinned copy + event instead of a
# stream-wide tolist). $OUT/ho<C>.json
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session41/TREE)"
for c in 64 256; do
  timeout 150 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $c --requests $((c * 3)) \
      --rounds 2 --configs nospec_sync,nospec,spec_off,adaptive_forced0 --output-file $OUT/ho$c.json 2>&1 \
      | grep -E "ms/step|Error|error" | tail -6
done
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -k "overlap" -p no:cacheprovider 2>&1 | tail -2
