#!/bin/bash
# Session 44, second lease (no GGUF; carry .whl_spy): what a spec engine's plain step adds on the GPU host at 64
# requests, sampled (py-spy --idle, 1 kHz) instead of cProfile/torch.profiler, which slow what they time:
# host_overhead with SmolLM2's shapes (random weights, shipped head), no-spec / threshold 0 / adaptive at plain
# decoding, 3 interleaved rounds; then pyspy_diff.py per function. $OUT/ho64.json, spy64.txt, spy64.json
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(git rev-parse --short HEAD)"
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl_spy/*.whl 2>&1 | tail -1
C=${1:-64}
timeout ${2:-300} /tmp/spy/bin/py-spy record --nonblocking --idle -r 1000 -f raw -o $OUT/spy$C.txt -- \
  python3 benchmarks/host_overhead.py --device cuda --dummy-smollm2 --concurrency $C --requests $((C * 8)) \
      --rounds 3 --top 10 --configs nospec,spec_off,adaptive_at_0 --output-kind delta \
      --output-file $OUT/ho$C.json 2>&1 | grep -vE "Warning|warn|behind" | cut -c1-160 | tail -30
python3 benchmarks/pyspy_diff.py $OUT/spy$C.txt $OUT/ho$C.json --rate 1000 --top 30 --output-file $OUT/spy$C.json \
  | cut -c1-150 | head -140
gzip $OUT/spy$C.txt
