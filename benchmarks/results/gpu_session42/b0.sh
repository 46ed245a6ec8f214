#!/bin/bash
# Session 42, call 1 (no GGUF): host_overhead with SmolLM2's shapes (random weights, the shipped head) at 64 and
# 256 requests: step-by-step no-spec against overlapped no-spec, a spec engine never drafting and adaptive held
# at plain decoding (session 41's a4: spec engines at 0.95-0.96x / 0.94-0.95x of overlapped no-spec), after this
# session's host trims (DecodeStream detokenizer; the spec engine's plain step without its passes over the
# batch); then the overlap scheduling GPU tests. $OUT/ho64.json, $OUT/ho256.json, $OUT/tests0.txt
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session42/TREE)" | tee $OUT/tests0.txt
for c in 64 256; do
  timeout 140 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $c --requests $((c * 2)) \
      --rounds 2 --configs nospec_sync,nospec,spec_off,adaptive_forced0 --output-kind delta --output-file $OUT/ho$c.json 2>&1 \
      | grep -E "ms/step|Error|error" | cut -c1-150 | tail -6
done
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_graphs.py -k "overlap" -p no:cacheprovider 2>&1 | tail -2 | tee -a $OUT/tests0.txt
