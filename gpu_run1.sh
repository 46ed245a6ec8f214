#!/bin/bash
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 256,256 --configs nospec,spec_off,adaptive \
  --output-len 128 --requests-per-c 2 --num-kv-blocks 16384 --log-cycles --output-file $OUT/r/breakdown_256.json > $OUT/r/breakdown_256.log 2>&1
tail -8 $OUT/r/breakdown_256.log
python3 benchmarks/adaptive.py --model /tmp/m.gguf --concurrency 1,4,16,64,256 --static-steps 3,5 --adaptive-steps 5 \
  --output-len 128 --max-input-len 300 --num-kv-blocks 16384 --point-s 12 --threshold-n 0 --off-s 0 --ramp "" \
  --max-wait 2 --retry-noisy 0 --output-dir $OUT/r/interleaved > $OUT/r/interleaved.log 2>&1
tail -25 $OUT/r/interleaved.log
