#!/bin/bash
# Session 28, second call: one request, configs alternating per prompt; then the breakdown under the profiler.
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/r
git log -1 --format=%H > $OUT/r/commit2.txt; git status --short >> $OUT/r/commit2.txt
timeout 300 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 10 \
    --configs nospec,chain3,chain5,chain5+noearly --parity-prompts 20 --skip-fp32-parity \
    --output-file $OUT/r/c1.json > $OUT/r/c1.log 2>&1
tail -12 $OUT/r/c1.log
timeout 240 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 1 \
    --configs nospec,static_chain5,static_chain5+noearly --output-len 128 --requests-per-c 4 --profile \
    --output-file $OUT/r/bd_profile.json > $OUT/r/bd_profile.log 2>&1
grep -E "^C=|gpu_kernel|profiled" $OUT/r/bd_profile.log | cut -c1-400
python3 -c "
import json; d=json.load(open('$OUT/r/bd_profile.json'))
for p in d['points']:
    for n,c in p['configs'].items(): print(p.get('concurrency'), n, {k:v for k,v in c.items() if 'ms' in k and not isinstance(v,(list,dict))})
" 2>&1 | tail -8
