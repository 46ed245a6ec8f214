#!/bin/bash
# Session 43, burst 1 (after staging the GGUF; $1 = the last part's directory): where an adaptive engine's plain
# steps lose time against a spec engine never drafting and overlapped no-spec (H100, session 42: 1.55-1.65 ms a
# plain step at 16 requests against ~1.35-1.39): phases, path counts, GPU kernel time per step (torch.profiler)
# and cProfile, at 16 and 64 requests; then the 8B-shaped decode and the Triton tests (session 42's b1.sh).
# $OUT/bd.json, $OUT/gpu_decode.json, $OUT/tests.txt
export PYTHONPATH=/tmp/site:$PWD
[ -n "$1" ] && bash benchmarks/gpu_stage.sh $1 18 | tail -1
echo "tree $(cat benchmarks/results/gpu_session43/TREE)" | tee $OUT/tests.txt
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee -a $OUT/tests.txt
timeout 240 python3 benchmarks/gpu_step_breakdown.py --model /tmp/m.gguf --concurrency 16,64 \
    --configs nospec,spec_off,adaptive@0,adaptive --output-len 128 --requests-per-c 4 --profile --log-cycles \
    --output-file $OUT/bd.json 2>&1 | grep -v "^  paths" | cut -c1-400
timeout 300 python3 benchmarks/gpu_decode.py --iters 15 --no-unfused --verify-tokens 1,16,128 --also-kv-cache-dtype fp8 \
    --out $OUT/gpu_decode.json 2>&1 | tail -30
timeout 100 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/tests.txt
