#!/usr/bin/env bash
# The exact pipeline behind the shipped drafter (specdecode/drafters/smollm2-135m-instruct-eagle3).
# Every step resumes where it stopped: run it again after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
SHARED=${SHARED:-../shared/data}
DATA=${DATA:-data/smollm2-selfinstruct}
OUT=${OUT:-runs/smollm2-eagle3}
SD=.venv/bin/specdecode

# 1. training data: the target answers the self-instruct seed tasks, the user-oriented
#    instructions and 2500 instructions it bootstraps from them (bf16, 30% sampled).
$SD data build --out "$DATA" --dtype bfloat16 --batch-size 32 --max-new-tokens 256 --bootstrap 2500 \
    --prompts "$SHARED/self_instruct_seed_tasks.jsonl" "$SHARED/user_oriented_instructions.jsonl"

# 2. the drafter (all samples) and the data-scaling points (subsets of the same data)
$SD train --data "$DATA" --out "$OUT/full" ${TRAIN_ARGS:-}
for n in ${SCALING_SIZES:-}; do
    $SD train --data "$DATA" --out "$OUT/n$n" --limit-samples "$n" ${TRAIN_ARGS:-}
done
