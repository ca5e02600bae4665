#!/usr/bin/env bash
# Session 2: the drafter retrained on the completed data set (2709 train samples) against the
# session-1 drafter (1461 samples): held-out trainer-vs-engine acceptance on the same held-out
# set, and Spec-Bench end to end, both drafters interleaved in one run.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results
OLD=${OLD:-runs/smollm2-eagle3/full}
NEW=${NEW:-runs/smollm2-eagle3/n2709}
for d in "$OLD" "$NEW"; do
    $SD eval-drafter --data data/smollm2-selfinstruct --drafter "$d" --depth 3 --samples 40 --dtype bfloat16 \
        --threads 2 | tee "$R/eval-drafter-$(basename "$d")-heldout137.json"
done
$SD bench --dtype bfloat16 --threads 2 --prompts ../shared/data/spec_bench_questions.jsonl --per-category 2 \
    --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench-specbench-bf16-drafters.json" \
    --methods "baseline,eagle3:steps=2,drafter=$OLD,eagle3:steps=2,drafter=$NEW,eagle3:steps=3,drafter=$NEW,eagle3:steps=1,topk=2,draft_tokens=3,drafter=$NEW" \
    | tee "$R/bench-specbench-bf16-drafters.txt"
