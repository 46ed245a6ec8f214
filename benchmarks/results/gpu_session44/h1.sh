#!/bin/bash
# Session 44, first lease (no GGUF): where a spec engine's plain step spends host time that no-spec's does not, on
# the GPU host. host_overhead with SmolLM2's shapes (random weights, the shipped head: the adaptive engine stays at
# plain decoding) at 16 and 64 requests, 3 interleaved rounds of 16 requests per slot, with the per-function
# own-time difference (cProfile) and the torch ops per step (torch.profiler) against no-spec. $OUT/ho<C>.json
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(git rev-parse --short HEAD)"
for c in 16 64; do
  timeout 200 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $c --requests $((c * 16)) \
      --rounds 3 --top 30 --configs nospec,nospec_b,spec_off,adaptive_at_0 --output-kind delta --torch-profile \
      --output-file $OUT/ho$c.json 2>&1 | grep -vE "Warning|warn" | cut -c1-160 | tail -80
done
