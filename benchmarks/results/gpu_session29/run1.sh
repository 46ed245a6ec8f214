#!/bin/bash
# Session 29's first call, at 0792e40: session 28's run6.sh as written there (the fused launch graph's GPU tests,
# gpu_spec_c1 chain5 vs chain5+nograph, the step breakdown; SPECSERVE_FUSED_LAUNCH_GRAPH=1, since dropped).
exec bash benchmarks/results/gpu_session28/run6.sh "$@"
