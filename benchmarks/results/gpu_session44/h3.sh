#!/bin/bash
# Session 44, third lease (no GGUF): the GPU tests of features written by the target's graph and of lossless
# speculation with graphs, then the plain-step host cost at 64 requests with SmolLM2's shapes: no-spec, threshold 0
# (features written by its forward), threshold 0 with the features scattered after it (before this session).
# $OUT/tests.txt, $OUT/ho64.json
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py -k "features or lossless" \
    2>&1 | tail -6 | tee $OUT/tests.txt
# (the host-cost A/B below runs only where the device time allows: set RUN_HO=1)
[ -n "$RUN_HO" ] && timeout 110 python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency 64 --requests 256 \
    --rounds 3 --top 10 --configs nospec,spec_off,spec_off_scattered --output-kind delta \
    --output-file $OUT/ho64.json 2>&1 | grep -E "ms/step|Error" | cut -c1-140
