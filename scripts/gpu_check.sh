#!/usr/bin/env bash
# GPU readiness (issue 22), one shot on a CUDA machine: does the engine give the same tokens eager and
# compiled (CUDA graphs: --compile on runs torch.compile mode="reduce-overhead" there), alone and batched,
# and how fast is it. Results (tables and JSON) under benchmarks/results/gpu/:
#   equality-fp32.*  fp32 greedy, Spec-Bench 1 per category x 64 tokens: baseline eager / compiled, EAGLE-3
#                    eager / compiled; bench's "same output" column compares every method with the first
#   speed-bf16.*     bf16, 2 per category x 128 tokens: the same four methods, interleaved
#   batched-*.*      continuous batching at concurrency 1, 4 and 16, speculative and plain steps, eager and compiled
# About 10-15 minutes on one GPU for SmolLM2-135M. Exits 2 with a message where no CUDA device is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch" || { echo "gpu_check.sh: $PY cannot import torch; run scripts/setup.sh first" >&2; exit 2; }
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh needs a CUDA device: torch.cuda.is_available() is False with $PY; run it on a GPU machine" \
         "(scripts/setup.sh there installs a CUDA build of torch)" >&2
    exit 2
fi
SD=("$PY" -m specdecode)
R=${RESULTS:-benchmarks/results/gpu}
SPEC=${SPEC:-../shared/data/spec_bench_questions.jsonl}
mkdir -p "$R"
M="baseline:compile=off,baseline:compile=on,eagle3:compile=off,eagle3:compile=on"
"${SD[@]}" bench --device cuda --dtype float32 --weights native --prompts "$SPEC" --per-category 1 \
    --max-new-tokens 64 --warmup 1 --compile off --no-store --out "$R/equality-fp32.json" --methods "$M" \
    2>&1 | tee "$R/equality-fp32.txt"
"${SD[@]}" bench --device cuda --dtype bfloat16 --weights native --prompts "$SPEC" --per-category 2 \
    --max-new-tokens 128 --warmup 1 --compile off --no-store --out "$R/speed-bf16.json" --methods "$M" \
    2>&1 | tee "$R/speed-bf16.txt"
for C in off on; do
    "${SD[@]}" bench --device cuda --dtype bfloat16 --weights native --prompts "$SPEC" --per-category 2 \
        --max-new-tokens 128 --warmup 1 --compile "$C" --concurrency 1,4,16 --spec-policy always,never \
        --no-store --out "$R/batched-$C.json" 2>&1 | tee "$R/batched-$C.txt"
done
