#!/bin/bash
# Session 33: a one-request cycle's host time on the H200, tiny random model (nothing staged): no-spec, chain 5, tree.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
tag=${1:-base}
python3 benchmarks/host_overhead.py --device cuda --concurrency 1 --requests 8 --max-tokens 128 \
    --configs nospec,static_chain5,static_tree --rounds 3 --top 45 --output-file $OUT/r/ho1_$tag.json > $OUT/r/ho1_$tag.log 2>&1
python3 benchmarks/host_overhead.py --device cuda --concurrency 1 --requests 8 --max-tokens 128 \
    --configs static_tree --rounds 1 --top 70 --sort cumulative --filter specserve/ --output-file $OUT/r/ho1c_$tag.json > $OUT/r/ho1c_$tag.log 2>&1
grep -E "ms/step" $OUT/r/ho1_$tag.log
