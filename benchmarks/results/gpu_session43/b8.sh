#!/bin/bash
# Session 43, last minutes of the budget (no GGUF): host_overhead with SmolLM2's shapes (random weights, the shipped
# head: the adaptive engine stays at plain decoding) at 16 and 64 requests: step-by-step / overlapped no-spec, a
# spec engine never drafting and the free adaptive engine at plain decoding (its full decisions before the
# sync, quick turns once the budget is spent). $OUT/ho16.json, $OUT/ho64.json
export PYTHONPATH=/tmp/site:$PWD
for c in 16 64; do
  timeout 70 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $c --requests $((c * 4)) \
      --rounds 2 --configs nospec,spec_off,adaptive_at_0 --output-kind delta --output-file $OUT/ho$c.json 2>&1 \
      | grep -E "ms/step|Error|error" | cut -c1-150 | tail -4
done
