#!/bin/bash
# Session 44, third lease (no GGUF): the GPU tests (features written by the target's graph, graphs, overlap,
# lossless speculation) and the plain-step host cost at 64 requests with SmolLM2's shapes: no-spec, threshold 0
# (features written by its forward), threshold 0 with the features scattered after it (before this session),
# adaptive at plain decoding. $OUT/tests.txt, $OUT/ho64.json
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(git log --oneline -1 | cut -c1-8)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py tests/test_draft_graph.py 2>&1 | tail -8 \
  | tee $OUT/tests.txt
timeout 260 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency 64 --requests 512 \
    --rounds 4 --top 10 --configs nospec,spec_off,spec_off_scattered,adaptive_at_0 --output-kind delta \
    --output-file $OUT/ho64.json 2>&1 | grep -E "ms/step|Error" | cut -c1-140
