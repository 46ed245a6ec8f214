#!/usr/bin/env bash
# How the shipped head models/smollm2-135m-eagle3 was trained (one H200; see its README.md).
#
#   GGUF=SmolLM2-135M-Instruct.Q4_1.gguf DATA=sharegpt_first_exchange.jsonl.gz WORK=/tmp/th \
#       bash benchmarks/train_head.sh
#
# DATA comes from `benchmarks/train_data.py sharegpt` (ShareGPT first exchanges, indices preserved, so the
# held-out split is ShareGPT's own). Steps:
# 1. prepare: regenerate the first reply of each training conversation greedily with the target
#    through our engine (self-distillation, time-boxed by DISTILL_S; conversations not reached keep
#    ShareGPT's reply) and tokenize with the target's chat template. DISTILLED=file.jsonl[.gz]
#    (a train_conversations.jsonl of an earlier prepare) is reused; conversations its budget did
#    not reach are regenerated now.
# 2. train one head per learning rate in LRS side by side on the GPU for TRAIN_S seconds each
#    (the time budget, not --epochs, ends the run: 420 s is ~9 epochs on one H200);
#    each measures greedy acceptance on held-out ShareGPT prompts at the end.
# TURNS=3 distills (and trains on) up to three exchanges per conversation (DATA from
# `train_data.py sharegpt --turns 3`; a DISTILLED file of fewer turns is extended); INIT=head_dir continues
# training that head (its draft vocab kept); SEED changes the batch order, never the held-out split.
set -euo pipefail
: "${GGUF:?path to the target GGUF}" "${DATA:?ShareGPT first-exchange JSONL}"
WORK=${WORK:-/tmp/train_head}
LRS=${LRS:-"1e-3"}
TRAIN_S=${TRAIN_S:-420}
COMMON=(--model "$GGUF" --data "$DATA" --draft-vocab-size 8192 --heldout 1000 --split-seed 0 --seed "${SEED:-0}"
        --max-len 1536 --max-prompt-len 1024 --self-distill --distill-turns "${TURNS:-1}"
        --distill-max-tokens 512 --distill-batch 512
        --distill-time-budget "${DISTILL_S:-150}" --batch-tokens 16384 --ttt-steps 7 --epochs 100
        --eval-conversations "${EVAL_N:-200}" --eval-max-tokens 256 --eval-time-budget 40 --no-progress ${EXTRA:-})
mkdir -p "$WORK/prep"
RESUME=()
if [ -n "${DISTILLED:-}" ]; then
    if [[ "$DISTILLED" == *.gz ]]; then zcat "$DISTILLED"; else cat "$DISTILLED"; fi > "$WORK/prep/train_conversations.jsonl"
    RESUME=(--resume)
fi
python3 -m specserve.train "${COMMON[@]}" --output-dir "$WORK/prep" --prepare-only "${RESUME[@]}" 2>&1 | tee "$WORK/prep.log"
i=0
for lr in $LRS; do
    rm -rf "$WORK/run$i" && cp -r "$WORK/prep" "$WORK/run$i"
    python3 -m specserve.train "${COMMON[@]}" --output-dir "$WORK/run$i" --resume --distill-time-budget 0 \
        ${INIT:+--init-from "$INIT"} --lr "$lr" --time-budget "$TRAIN_S" > "$WORK/run$i.log" 2>&1 &
    i=$((i + 1))
done
wait
tail -n 3 "$WORK"/run*.log
