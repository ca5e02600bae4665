#!/usr/bin/env bash
# Drafter v3 against v2 (issue 13), all on this machine with two threads:
#   1. held-out acceptance on the v3 data set's held-out split, the trainer's estimate against the
#      engine's measurement, both drafters (chain of 3, bf16, 40 samples);
#   2. the configuration sweep with v3 (bf16, Spec-Bench 1 prompt per category, 96 tokens);
#   3. Spec-Bench end to end, one interleaved run: the baseline, v2 at its default configuration,
#      v3 at the sweep's best (2 steps, top-2, 5 tokens) and its neighbours (bf16, 2 prompts per
#      category, 128 tokens);
#   4. losslessness in fp32: v3 at the default configuration and a tree, speculative greedy against
#      the baseline on Spec-Bench (3 prompts per category, 64 tokens);
#   5. v3 with the main job's weight format (bf16, the GGUF's 4-bit weights), where a verify of
#      several tokens costs more than in bf16: the default against smaller drafts.
# v2 is taken from git history (the commit before v3 replaced it).
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results/drafter-v3
V3=${V3:-specdecode/drafters/smollm2-135m-instruct-eagle3}
V2=${V2:-runs/drafter-v2}
V2_COMMIT=${V2_COMMIT:-9042826}
DATA=${DATA:-datasets/smollm2-135m-corpus-v3}
SPEC=../shared/data/spec_bench_questions.jsonl
mkdir -p "$R" "$V2"
for f in config.json model.safetensors; do
    [ -f "$V2/$f" ] || git show "$V2_COMMIT:specdecode/drafters/smollm2-135m-instruct-eagle3/$f" > "$V2/$f"
done

# a step whose result file exists is skipped: delete it to measure again
for d in v2:"$V2" v3:"$V3"; do
    [ -s "$R/eval-drafter-${d%%:*}-heldout.json" ] && continue
    $SD eval-drafter --data "$DATA" --drafter "${d#*:}" --depth 3 --samples 40 --dtype bfloat16 --threads 2 \
        | tee "$R/eval-drafter-${d%%:*}-heldout.json"
done

[ -s "$R/sweep-bf16/sweep.json" ] || $SD sweep --drafter "$V3" --num-steps 1,2,3,4 --topk 1,2 --prompts "$SPEC" --per-category 1 --max-new-tokens 96 \
    --dtype bfloat16 --threads 2 --no-store --out "$R/sweep-bf16" | tee "$R/sweep-bf16.txt"

[ -s "$R/bench-specbench-bf16.json" ] || $SD bench --dtype bfloat16 --threads 2 --prompts "$SPEC" --per-category 2 --max-new-tokens 128 --warmup 1 \
    --no-store --out "$R/bench-specbench-bf16.json" \
    --methods "baseline,eagle3:steps=1,topk=2,drafter=$V2,eagle3:steps=1,topk=2,drafter=$V3,eagle3:steps=2,topk=1,drafter=$V3,eagle3:steps=2,topk=2,draft_tokens=5,drafter=$V3,eagle3:steps=3,topk=1,drafter=$V3" \
    | tee "$R/bench-specbench-bf16.txt"

[ -s "$R/check-fp32-default.json" ] || $SD check --drafter "$V3" --dtype float32 --threads 2 --prompts "$SPEC" --per-category 3 --max-new-tokens 64 \
    --out "$R/check-fp32-default.json" | tee "$R/check-fp32-default.txt"
[ -s "$R/check-fp32-tree.json" ] || $SD check --drafter "$V3" --num-steps 3 --topk 2 --num-draft-tokens 6 --dtype float32 --threads 2 --prompts "$SPEC" \
    --per-category 3 --max-new-tokens 64 --out "$R/check-fp32-tree.json" | tee "$R/check-fp32-tree.txt"

[ -s "$R/bench-specbench-q4.json" ] || $SD bench --dtype bfloat16 --weights q4 --threads 2 --prompts "$SPEC" \
    --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench-specbench-q4.json" \
    --methods "baseline,eagle3,eagle3:steps=1,topk=2,eagle3:steps=2,topk=1,eagle3:steps=1,topk=1" \
    | tee "$R/bench-specbench-q4.txt"
