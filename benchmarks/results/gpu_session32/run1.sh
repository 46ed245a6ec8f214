#!/bin/bash
# Session 32's first GPU calls, at 0b0d5db (session 31's code), after staging (benchmarks/gpu_stage.sh):
# c1tests/: the GPU tests and one request, natural stops
#   python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py
#   python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
#       --configs nospec,chain3,chain5,tree,tree12 --parity-prompts 10 --skip-fp32-parity --output-file c1.json
# sweep1/: session 31's run_next.sh (the A/B of fuse_explorations, isolate_explorations, fuse_exploit off):
#   bash benchmarks/results/gpu_session31/run_next.sh a
# host/ (no staging: the tiny random model and head of tests/tiny_model.py), at bce26c5's host_overhead.py:
for c in 1 16; do
  python3 benchmarks/host_overhead.py --device cuda --concurrency $c --requests 48 --max-tokens 96 \
      --configs nospec,spec_off,adaptive_at_0,static_chain3,adaptive_forced3 --sort cumulative --filter specserve/ \
      --top 60 --output-file $OUT/r/ho_c$c.json
done
