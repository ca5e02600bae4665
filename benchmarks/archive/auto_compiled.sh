#!/usr/bin/env bash
# --spec-config auto beside stored graphs (issue 22): which shape `generate`'s default decodes with when the
# run has the graphs `specdecode compile` stored, and what each candidate measures with those graphs.
#  1. stores the graphs (cache size 256) of plain decoding and of the shapes measured (stored ones are kept)
#  2. records the choice `generate --compile auto` makes (choice.json: auto's predictions, and whether it
#     decodes plain)
#  3. one interleaved bench with those graphs: plain decoding, eagle3 (auto's best speculative shape) and two
#     shapes eager calibration chose on the Zen4 EPYC (2/1/3 in session 15, 3/1/4 in session 16); Spec-Bench
#     prompts of at most 60 words, the first of each category, 96 new tokens: every request fits 256 slots.
# Default format (bf16 + the GGUF's 4-bit weights on a CPU with bf16), 2 threads. Stop data generation first.
# Writes $OUT/choice.json, run.json and run.txt (default OUT=benchmarks/results/auto-compiled).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/auto-compiled}
SPEC=${SPEC:-../shared/data/spec_bench_questions.jsonl}
SD=(.venv/bin/python -m specdecode)
mkdir -p "$OUT"
for shape in "--no-spec" "--num-steps 1 --topk 1" "--num-steps 2 --topk 1 --num-draft-tokens 3" \
             "--num-steps 3 --topk 1 --num-draft-tokens 4"; do
    # shellcheck disable=SC2086
    "${SD[@]}" compile --compile-max-len 256 --threads 2 $shape
done
"${SD[@]}" generate "Write a short poem about the sea." --max-new-tokens 64 --threads 2 --compile auto --json \
    | .venv/bin/python -c "import json, sys; d = json.load(sys.stdin); json.dump({k: d.get(k) for k in \
('method', 'compile', 'graphs_loaded', 'spec_choice', 'tok_per_s')}, sys.stdout, indent=1)" > "$OUT/choice.json"
"${SD[@]}" bench --compile on --threads 2 --prompts "$SPEC" --per-category 1 --max-prompt-words 60 \
    --max-new-tokens 96 --out "$OUT/run.json" \
    --methods "baseline,eagle3,eagle3:steps=2,topk=1,draft_tokens=3,eagle3:steps=3,topk=1,draft_tokens=4" \
    | tee "$OUT/run.txt"
