#!/bin/bash
# NOT RUN in session 31 (its device time was spent): the next session's calls, after staging.
# (a) the A/B the adaptive pick needs, twice: fuse_explorations on, isolate_explorations on, and
#     fuse_exploit off, beside the default, every engine's cycles logged (which depth each settles on, what
#     its cycles measured, fused or not: CycleLog's fused_share / tok_s_raw_fused);
# (b) one request again (tree vs chain 5 after topk_logprobs and the fused steps near a request's end).
# Each sweep ~4-5 min: one per call (bash run_next.sh 1, then bash run_next.sh 2).
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
rep=${1:-1}
if [ "$rep" = 1 ]; then  # the GPU tests first: session 31 changed fused launches without running them
  timeout 150 python3 -m pytest -q -x -m gpu tests/test_gpu_graphs.py tests/test_draft_graph.py > $OUT/r/gpu_tests.log 2>&1
  tail -2 $OUT/r/gpu_tests.log
fi
timeout 450 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16 --static-steps 5 --adaptive-steps 5 \
    --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
    --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant fexp:fuse_explorations=True --variant iso:isolate_explorations=True \
    --variant noexploit:fuse_exploit=False --log-cycles --output-dir /tmp/sweep_iso$rep > $OUT/r/sweep_iso$rep.log 2>&1
tar czf $OUT/r/sweep_iso$rep.tgz -C /tmp sweep_iso$rep
grep -E "^C=" $OUT/r/sweep_iso$rep.log | cut -c1-250
if [ "$rep" = 1 ]; then
  timeout 120 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 --natural-stops \
      --configs nospec,chain3,chain5,tree,tree12 --parity-prompts 10 --skip-fp32-parity \
      --output-file $OUT/r/c1.json > $OUT/r/c1.log 2>&1
  grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity" $OUT/r/c1.log | cut -c1-110
fi
