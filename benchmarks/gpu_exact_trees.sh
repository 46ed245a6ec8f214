#!/bin/bash
# Exact trees on the GPU, after staging the SmolLM2 GGUF at /tmp/m.gguf (benchmarks/gpu_stage.sh):
# greedy parity of tree 5x4x32 against no-spec (50 prompts x 128 tokens; bf16, and fp32 unless
# FP32=0), then C = 1 speed (50 prompts, natural stops) for each attention mode in its own process:
#   exact   the default (every key range of a tree token its own),
#   prefix  exact with the ranges below the tree shared by tiles of several tokens
#           (SPECSERVE_EXACT_SHARED_PREFIX=1),
#   shared  shared tiles (SPECSERVE_EXACT_TREES=0: faster, bf16 roundings may differ from no-spec's).
# Usage: bash benchmarks/gpu_exact_trees.sh <output dir> [modes, default "exact prefix shared"]
set -u
R=${1:?output dir}; MODES=${2:-exact prefix shared}
mkdir -p "$R"
env_for() {
  case $1 in
    exact) echo "SPECSERVE_EXACT_TREES=1 SPECSERVE_EXACT_SHARED_PREFIX=0" ;;
    prefix) echo "SPECSERVE_EXACT_TREES=1 SPECSERVE_EXACT_SHARED_PREFIX=1" ;;
    shared) echo "SPECSERVE_EXACT_TREES=0 SPECSERVE_EXACT_SHARED_PREFIX=0" ;;
    *) echo "unknown mode $1" >&2; exit 2 ;;
  esac
}
fp32=$([ "${FP32:-1}" = 0 ] && echo --skip-fp32-parity)
for m in $MODES; do
  [ $m = shared ] && continue  # (shared tiles are not meant to be bit for bit)
  env $(env_for $m) timeout 300 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 4 \
      --configs nospec,chain3,tree32 --parity-config tree32 --parity-prompts 50 $fp32 \
      --output-file "$R/parity_$m.json" > "$R/parity_$m.log" 2>&1
  echo "== parity $m"; grep -E "^parity|Error|error" "$R/parity_$m.log" | cut -c1-160
done
for m in $MODES; do
  env $(env_for $m) timeout 200 python3 benchmarks/gpu_spec_c1.py --model /tmp/m.gguf --num-prompts 50 --natural-stops \
      --configs nospec,chain3,tree32 --parity-prompts 10 --skip-fp32-parity \
      --output-file "$R/c1_$m.json" > "$R/c1_$m.log" 2>&1
  echo "== c1 $m"; grep -E "^(nospec|chain3|tree32):.*tok/s|Error|error" "$R/c1_$m.log" | cut -c1-110
done
