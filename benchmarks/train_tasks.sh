#!/usr/bin/env bash
# One device call (~510 s on one GPU): the target's own replies to varied training prompts (greedy and
# sampled), the shipped head continued on them, then both heads measured per task in the engine.
#
#   python benchmarks/train_data.py prompts .trainprompts/train_prompts.jsonl.gz      # here, once
#   # there, after benchmarks/gpu_stage.sh (carry [".trainprompts"]):
#   export PYTHONPATH=/tmp/site:$PWD; GGUF=/tmp/m.gguf RES=$OUT bash benchmarks/train_tasks.sh
#
# 1. distill (DISTILL_S s): `train_data.py distill` answers PROMPTS from START on with the target through
#    our engine, once per temperature in TEMPS, turn by turn (it prints next_start: START for new prompts
#    next time); DISTILLED=file(s) (earlier runs' replies, space-separated) with DISTILL_S=0 skips this
#    step, with DISTILL_S > 0 trains on both.
# 2. train (TRAIN_S s): continue INIT (--init-from: its draft vocab and weights) on those conversations with
#    a TTT depth of TTT steps (5: the deepest chain and tree we serve), lr LR, the schedule over the budget.
#    The prompts came from conversations outside the held-out split, so the trainer holds none out.
#    REMAP=1 (the default; 0: keep INIT's) re-chooses the draft vocab (same size) from these replies
#    (--remap-vocab): the shipped one holds 84 % of the target's translation tokens, 96 % of chat's.
# 3. evaluate: benchmarks/heldout_acceptance.py --tasks on the held-out multi-task set plus CHAT chat
#    prompts, BASE (the shipped head) and the new head, chain 5 and the default tree, greedy (bf16 on a GPU).
# DISTILL_ARGS, TRAIN_ARGS and EVAL_ARGS are appended to each step's command (a CPU smoke run shrinks them).
# RES gets (8 files at most come back from a device call, 16 MiB each): tasks.json, train_summary.json,
# the head's config.json and model.safetensors in parts under 16 MiB (join: cat model.safetensors.part*),
# the new replies in parts likewise (distilled_from<START>_seed<SEED>.jsonl.gz, for DISTILLED next time), run.log.
set -euo pipefail
: "${GGUF:?path to the target GGUF}"
WORK=${WORK:-/tmp/tt}
RES=${RES:-$WORK/res}
PROMPTS=${PROMPTS:-.trainprompts/train_prompts.jsonl.gz}
BASE=models/smollm2-135m-eagle3
INIT=${INIT:-$BASE}
DISTILL_S=${DISTILL_S:-160}
TRAIN_S=${TRAIN_S:-190}
mkdir -p "$WORK" "$RES"
LOG="$RES/run.log"
: > "$LOG"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }

NEW="$WORK/distilled_from${START:-0}_seed${SEED:-0}.jsonl.gz"
DATA=()
for f in ${DISTILLED:-}; do DATA+=("$f"); done
if [ "${#DATA[@]}" -eq 0 ] || [ "$DISTILL_S" != 0 ]; then
    say "distill: $PROMPTS from ${START:-0}, temperatures ${TEMPS:-0,0.7,1.0}, ${DISTILL_S} s"
    python3 benchmarks/train_data.py distill --model "$GGUF" --prompts "$PROMPTS" --temperatures "${TEMPS:-0,0.7,1.0}" \
        --time-budget "$DISTILL_S" --start "${START:-0}" ${LIMIT:+--limit "$LIMIT"} --seed "${SEED:-0}" \
        ${DISTILL_ARGS:-} "$NEW" 2>&1 | grep -v "^generate" | tail -n 3 | tee -a "$LOG"
    split -b 15M -d -a 1 "$NEW" "$RES/$(basename "$NEW").part"
    DATA+=("$NEW")
fi
zcat -f "${DATA[@]}" > "$WORK/train.jsonl"
say "train: $(wc -l < "$WORK/train.jsonl") conversations, init $INIT, ${TRAIN_S} s"
rm -rf "$WORK/head"
python3 -m specserve.train --model "$GGUF" --data "$WORK/train.jsonl" --heldout 0 --init-from "$INIT" \
    --ttt-steps "${TTT:-5}" --lr "${LR:-3e-4}" --time-budget "$TRAIN_S" --epochs 100 --max-len 1536 \
    --batch-tokens 16384 --seed "${SEED:-0}" --eval-conversations 0 --log-every 100 --no-progress $([ "${REMAP:-1}" = 1 ] && echo --remap-vocab) \
    ${TRAIN_ARGS:-} --output-dir "$WORK/head" > "$WORK/train.log" 2>&1 || { tail -n 30 "$WORK/train.log" | tee -a "$LOG"; exit 1; }
grep -E "data:|draft vocab|done:" "$WORK/train.log" | cut -c 1-600 | tee -a "$LOG"
cp "$BASE/heldout.json" "$WORK/head/heldout.json"  # the split the prompts were built without
cp "$WORK/head/config.json" "$WORK/head/train_summary.json" "$RES/"
split -b 15M -d -a 1 "$WORK/head/model.safetensors" "$RES/model.safetensors.part"
say "evaluate"
python3 benchmarks/heldout_acceptance.py --tasks benchmarks/data/heldout_tasks.json --model "$GGUF" \
    --heads "$BASE" "$WORK/head" --configs "${CONFIGS:-chain5,tree}" --chat "${CHAT:-32}" --kv-cache-memory-gb 4 \
    ${EVAL_ARGS:-} --output-file "$RES/tasks.json" 2>&1 | grep -v "^generate" | tail -n 14 | tee -a "$LOG"
say "done"
