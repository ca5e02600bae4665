#!/usr/bin/env bash
# Drafter training data v3 (issue 13): the target (SmolLM2-135M-Instruct, bf16 activations, the
# GGUF's own 4-bit weights) answers prompts drawn from the shared training corpus with an equal
# share per category, greedy, up to 256 new tokens, 5% held out by prompt id. Resumable: run it
# again after an interruption and it continues where the data set stops (the draw is fixed by
# --sample and --seed; prompts already answered are skipped). Writes data/smollm2-135m-corpus-v3 (v3 itself left the tree: datasets/README.md).
# lm-sys__FastChat.jsonl is left out: those 78 prompts are Vicuna-bench's evaluation questions.
# scripts/train_default_drafter.sh calls it with other sizes (OUT, SAMPLE, DEVICE, WEIGHTS,
# BATCH_SIZE, MAX_NEW_TOKENS, HELDOUT_PERCENT, LIMIT) for its GPU variant and for its tests (COMPILE=off there:
# --compile auto compiles data build's steps, minutes of compiling that a tiny budget never pays back).
# Drafter v4's data (issue 25): OUT=datasets/smollm2-135m-corpus-v4 SAMPLE=16000 CATEGORY_WEIGHTS=... (see
# datasets/README.md; the directory starts as a copy of v3, whose answers are kept and never regenerated).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PROMPTS=${PROMPTS:-../shared/data/prompts}
mapfile -t FILES < <(ls "$PROMPTS"/*.jsonl "$PROMPTS"/long/*.jsonl | grep -v FastChat)
.venv/bin/specdecode data build --out "${OUT:-data/smollm2-135m-corpus-v3}" --dtype bfloat16 \
    --weights "${WEIGHTS:-q4}" --device "${DEVICE:-cpu}" --threads "${THREADS:-2}" --compile "${COMPILE:-auto}" \
    --batch-size "${BATCH_SIZE:-128}" --max-new-tokens "${MAX_NEW_TOKENS:-256}" --sample "${SAMPLE:-6000}" \
    --sampled-fraction 0 --seed 0 --heldout-percent "${HELDOUT_PERCENT:-5}" \
    ${LIMIT:+--limit "$LIMIT"} ${CATEGORY_WEIGHTS:+--category-weights "$CATEGORY_WEIGHTS"} --prompts "${FILES[@]}"
