#!/bin/bash
# Session 38, first call after staging: GPU tests of the changed paths (graph replays without copies on
# plain steps), then a spec engine's plain step against a no-spec engine's on the tiny model (host and
# launch time: session 37 measured 0.686 vs 0.590 ms at 16 requests, 1.358 vs 1.256 at 64).
export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py 2>&1 | tail -3 | tee $OUT/pytest_gpu.log
python3 -m pytest -q -x tests/test_triton_attention.py 2>&1 | tail -2 | tee $OUT/pytest_attention.log
for c in 16 64; do
  python3 benchmarks/host_overhead.py --device cuda --concurrency $c --requests $((c * 6)) --max-tokens 64 \
      --configs nospec,spec_off,nospec_b,adaptive_forced0 --rounds 3 --output-file $OUT/ho$c.json 2>&1 | grep "ms/step"
done
