#!/bin/bash
# Session 43 (GGUF staged; $1 = the last part's directory, staged first; $2 = concurrencies): the adaptive sweep
# with full decisions after plain steps taken before the sync (fuse_plain_full) beside an adaptive engine
# without it (variant prev), 10-s points; then C = 1 speculation (session 42's b3.sh). $OUT/sweep/, $OUT/c1.json
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 18 | tail -1
echo "tree $(cat benchmarks/results/gpu_session43/TREE)"
timeout ${3:-400} python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency ${2:-1,4,16,64,256} --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant prev:fuse_plain_full=False \
    --log-cycles --output-dir $OUT/sweep 2>&1 | tail -16
(cd $OUT/sweep && ls cycles_*.json >/dev/null 2>&1 && tar czf cycles.tgz cycles_*.json && rm cycles_*.json)
ls $OUT/sweep
