#!/bin/bash
# Session 42, after staging the GGUF (18 parts, benchmarks/gpu_stage.sh): C = 1 speculation against a no-spec
# engine that is overlap scheduled now (#8: >= 2.5x; session 37's exact-tree default made 2.45x against the
# step-by-step one), then the adaptive sweep at 64 and 256 requests (g4.sh's settings with 10-s points: every
# engine in one process, 0.5-s slices, the held-at-5 engine beside, cycles logged). $OUT/c1.json, $OUT/high/
export PYTHONPATH=/tmp/site:$PWD
echo "tree $(cat benchmarks/results/gpu_session42/TREE)"
md5sum /tmp/m.gguf
timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
    --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity --output-file $OUT/c1.json > $OUT/c1.log 2>&1
grep -E "^(nospec|chain3|tree32):.*tok/s|^parity|Error|error" $OUT/c1.log | cut -c1-140
time timeout 360 python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency ${1:-64,256} --static-steps 3,5 \
    --adaptive-steps 5 --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 10 --threshold-n 0 \
    --off-s 0 --ramp '' --max-wait 2 --retry-noisy 0 --slice-s 0.5 --variant held5:forced_arm=5 --log-cycles \
    --output-dir $OUT/high 2>&1 | tail -30
(cd $OUT/high && ls cycles_*.json >/dev/null 2>&1 && tar czf cycles.tgz cycles_*.json && rm cycles_*.json)
ls -la $OUT $OUT/high
