#!/bin/bash
# NOT RUN in session 32 (its device time was spent): the next session's calls, after staging in ten parts
# (benchmarks/gpu_stage.sh .stageg<N> 10). One per call: bash run_next.sh 1, then 2, then 3.
# 1: larger trees at one request (CPU accept lengths in BENCHMARKS.md, session 32); where the adaptive engine's extra ~0.16 ms a cycle at 16 requests goes (static chain 5 against adaptive,
#    the engine's phases timed, with cProfile), and where a one-request tree cycle waits for the host
#    (the timeline of static_tree: the gap between the verify's sync and the next verify's launch).
# 2, 3: the sliced sweep again with fuse_full as a variant (one run so far: 0.953 / 0.947 / 1.012 against
#    0.941 / 0.959 / 0.970 for the default), at 1, 4, 16 and 64 requests.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
rep=${1:-1}
if [ "$rep" = 1 ]; then
  # larger trees at one request (a verify of 24-32 tokens costs about what one of 16 does there)
  timeout 120 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 20 --natural-stops \
      --configs nospec,chain3,chain5,tree,tree24,tree32,tree6x24 --parity-prompts 10 --skip-fp32-parity \
      --output-file $OUT/r/c1_trees.json > $OUT/r/c1_trees.log 2>&1
  grep -E "^(nospec|chain3|chain5|tree[0-9a-z+]*):.*tok/s|parity" $OUT/r/c1_trees.log | cut -c1-110
  timeout 240 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 16 --configs static_chain5,adaptive \
      --output-len 128 --requests-per-c 4 --profile --output-file $OUT/r/bd16.json > $OUT/r/bd16.log 2>&1
  tail -5 $OUT/r/bd16.log
  timeout 200 python3 benchmarks/gpu_timeline.py --model /tmp/m.gguf --configs nospec,static_chain5,static_tree \
      --output-len 64 --output-file $OUT/r/timeline.json > $OUT/r/timeline.log 2>&1
  tail -20 $OUT/r/timeline.log
else
  timeout 500 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16,64 --static-steps 5 --adaptive-steps 5 \
      --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 --off-s 0 --ramp "" \
      --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant full:fuse_full=True --log-cycles \
      --output-dir /tmp/sweep_full$rep > $OUT/r/sweep_full$rep.log 2>&1
  tar czf $OUT/r/sweep_full$rep.tgz -C /tmp sweep_full$rep
  grep -E "^C=" $OUT/r/sweep_full$rep.log | cut -c1-250
fi
