#!/usr/bin/env bash
# The pipeline behind the shipped drafter (specdecode/drafters/smollm2-135m-instruct-eagle3).
# Every step resumes where it stopped: run it again after an interruption.
# (The shipped run: the first 288 samples were generated with --batch-size 32 --max-new-tokens 256,
# the rest with the settings below. Session 1 stopped the build at 1536 samples and trained on them
# (drafter version 1, the 1461-sample point); session 2 completed it (2846 samples) and trained the
# shipped version 2 on all 2709 training samples with two threads.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
SHARED=${SHARED:-../shared/data}
DATA=${DATA:-data/smollm2-selfinstruct}
OUT=${OUT:-runs/smollm2-eagle3}
SD=.venv/bin/specdecode
TRAIN=(--draft-vocab-size 8192 --ttt-steps 7 --epochs 3 --lr 1e-3 --batch-tokens 2048 --eval-every 50
       --eval-samples 48 --save-every 10 --threads "${THREADS:-2}")

# 1. training data: the target answers the self-instruct seed tasks, the user-oriented instructions and
#    instructions it bootstraps from them (bf16; 30% sampled at T=0.7, top-p 0.9; 5% held out).
$SD data build --out "$DATA" --dtype bfloat16 --batch-size 48 --max-new-tokens 224 --bootstrap 2500 \
    --prompts "$SHARED/self_instruct_seed_tasks.jsonl" "$SHARED/user_oriented_instructions.jsonl"

# 2. the drafter on all training samples, and the data-scaling points (subsets of the same data)
$SD train --data "$DATA" --out "$OUT/n2709" "${TRAIN[@]}"
for n in 180 360 730 1461; do
    $SD train --data "$DATA" --out "$OUT/n$n" --limit-samples "$n" "${TRAIN[@]}"
done
$SD train-report "$OUT/n180" "$OUT/n360" "$OUT/n730" "$OUT/n1461" "$OUT/n2709" --plot "$OUT/data_scaling.png"
