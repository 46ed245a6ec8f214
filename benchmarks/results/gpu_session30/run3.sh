#!/bin/bash
# Session 30: device time of each graph of a one-request cycle (chain 5 against trees), and the wall per token.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
timeout 300 python3 benchmarks/gpu_graph_parts.py --model /tmp/m.gguf --configs chain5,tree,tree8 \
    --output-file $OUT/r/parts.json > $OUT/r/parts.log 2>&1
cut -c1-900 $OUT/r/parts.log | grep -v Warning
