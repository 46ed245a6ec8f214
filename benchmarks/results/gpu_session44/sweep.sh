#!/bin/bash
# For the next lease (written in session 44, which had none left for it): stage the GGUF in three calls back to back,
# with `bash benchmarks/gpu_lean.sh lean` run here first (`... restore` after the last call, before any commit):
#   bash benchmarks/results/gpu_session44/sweep.sh .stageh1             (carry .stageh1 and .whl)
#   bash benchmarks/results/gpu_session44/sweep.sh .stageh2             (carry .stageh2)
#   bash benchmarks/results/gpu_session44/sweep.sh .stageh3 1,4,16 300  (carry .stageh3): joins the parts, then sweeps
#   bash benchmarks/results/gpu_session44/sweep.sh "" 64,256 300        (the GGUF already in /tmp)
# The sweep: adaptive.py at 15-s points, no-spec / chains 3 and 5 / threshold 0 / adaptive, closed loop over
# ShareGPT prompts, cycle logs kept. $OUT/sweep_<concurrencies>/
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 3 | tail -1
[ -z "$2" ] && exit 0
[ -f /tmp/m.gguf ] || { echo "no /tmp/m.gguf: stage the three parts first"; exit 1; }
echo "tree $(git log --oneline -1 2>/dev/null | cut -c1-8)"
out=$OUT/sweep_${2//,/_}
timeout ${3:-300} python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency $2 --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 15 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --log-cycles --output-dir $out 2>&1 | tail -16
(cd $out && ls cycles_*.json >/dev/null 2>&1 && tar czf cycles.tgz cycles_*.json && rm cycles_*.json)
ls $out
