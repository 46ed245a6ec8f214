#!/bin/bash
# Session 43, second lease (GGUF staged; $1 = the last part's directory, staged first): the adaptive engine with
# drafting arms borrowing drafting cycles' excess time (bandit.drafting_excess) beside one without it (prev),
# at 16 and 64 requests, 10-s points. $OUT/sweep/
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 18 | tail -1
echo "tree $(cat benchmarks/results/gpu_session43/TREE)"
timeout ${3:-300} python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency ${2:-16,64} --static-steps 5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant prev:bandit.drafting_excess=False \
    --log-cycles --output-dir $OUT/sweep 2>&1 | tail -14
(cd $OUT/sweep && ls cycles_*.json >/dev/null 2>&1 && tar czf cycles.tgz cycles_*.json && rm cycles_*.json)
ls $OUT/sweep
