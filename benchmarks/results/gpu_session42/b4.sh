#!/bin/bash
# Session 42, after staging the GGUF (the last part staged here, $1): the adaptive sweep at 4, 16 and 64 requests
# with explorations of plain decoding launched ahead (plain_second_cycle) beside an adaptive engine without it
# (variant old) and one held at depth 5; g4.sh's settings with 10-s points. $OUT/sweep/
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 18 | tail -1
echo "tree $(cat benchmarks/results/gpu_session42/TREE)"
timeout 420 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency ${2:-4,16,64} --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant old:overlap_plain_explorations=False \
    --variant held5:forced_arm=5 --log-cycles --output-dir $OUT/sweep 2>&1 | tail -22
(cd $OUT/sweep && ls cycles_*.json >/dev/null 2>&1 && tar czf cycles.tgz cycles_*.json && rm cycles_*.json)
ls $OUT/sweep
