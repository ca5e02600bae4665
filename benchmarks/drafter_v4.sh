#!/usr/bin/env bash
# Drafter v4 against v3 (issue 25), all on this machine with two threads, eager steps (--compile off:
# the drafters are what differs, and cold graphs would cost more than the runs):
#   1. the acceptance table of the new drafter (what --spec-config auto reads), on the v4 data set's
#      held-out split, if the drafter directory has none yet;
#   2. held-out acceptance on the v4 data set's held-out split (v3's held-out prompts kept), the
#      trainer's estimate against the engine's measurement, both drafters (chain of 3, bf16, 40 samples);
#   3. Spec-Bench end to end, one interleaved run, bf16 native weights: the baseline, both drafters at
#      v3's default shape (2 steps, top-2, 5 tokens), v4 at the shape --spec-config auto chooses for it;
#   4. the same with the main job's weight format (bf16, the GGUF's 4-bit weights): the baseline, both
#      drafters at one step (top-1) and at the default shape;
#   5. losslessness in fp32: v4 at the default shape, speculative greedy against the baseline on
#      Spec-Bench (3 prompts per category, 64 tokens).
# v3 is taken from git history (the last commit that shipped it) unless V3 names a directory.
set -euo pipefail
cd "$(dirname "$0")/.."
SD=.venv/bin/specdecode
R=benchmarks/results/drafter-v4
V4=${V4:-specdecode/drafters/smollm2-135m-instruct-eagle3}
V3=${V3:-runs/drafter-v3}
V3_COMMIT=${V3_COMMIT:-17aa3aa}
DATA=${DATA:-datasets/smollm2-135m-corpus-v4}
SPEC=../shared/data/spec_bench_questions.jsonl
RUN=(--threads 2 --compile off)
mkdir -p "$R" "$V3"
for f in config.json model.safetensors acceptance.json; do
    [ -f "$V3/$f" ] || git show "$V3_COMMIT:specdecode/drafters/smollm2-135m-instruct-eagle3/$f" > "$V3/$f"
done

# a step whose result file exists is skipped: delete it to measure again
[ -s "$V4/acceptance.json" ] || $SD eval-drafter --data "$DATA" --drafter "$V4" --acceptance-table --samples "${TABLE_SAMPLES:-40}" \
    --dtype bfloat16 --weights q4 "${RUN[@]}"

for d in v3:"$V3" v4:"$V4"; do
    [ -s "$R/eval-drafter-${d%%:*}-heldout.json" ] && continue
    $SD eval-drafter --data "$DATA" --drafter "${d#*:}" --depth 3 --samples 40 --dtype bfloat16 "${RUN[@]}" \
        | tee "$R/eval-drafter-${d%%:*}-heldout.json"
done

[ -s "$R/bench-specbench-bf16.json" ] || $SD bench --dtype bfloat16 "${RUN[@]}" --prompts "$SPEC" --per-category 2 \
    --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench-specbench-bf16.json" \
    --methods "baseline,eagle3:steps=2,topk=2,draft_tokens=5,drafter=$V3,eagle3:steps=2,topk=2,draft_tokens=5,drafter=$V4,eagle3:drafter=$V4" \
    | tee "$R/bench-specbench-bf16.txt"

[ -s "$R/bench-specbench-q4.json" ] || $SD bench --dtype bfloat16 --weights q4 "${RUN[@]}" --prompts "$SPEC" \
    --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench-specbench-q4.json" \
    --methods "baseline,eagle3:steps=1,topk=1,drafter=$V3,eagle3:steps=1,topk=1,drafter=$V4,eagle3:steps=2,topk=2,draft_tokens=5,drafter=$V4" \
    | tee "$R/bench-specbench-q4.txt"

[ -s "$R/check-fp32-default.json" ] || $SD check --drafter "$V4" --num-steps 2 --topk 2 --num-draft-tokens 5 \
    --dtype float32 "${RUN[@]}" --prompts "$SPEC" --per-category 3 --max-new-tokens 64 \
    --out "$R/check-fp32-default.json" | tee "$R/check-fp32-default.txt"
