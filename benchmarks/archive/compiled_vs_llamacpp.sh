#!/usr/bin/env bash
# Our compiled steps against llama.cpp's llama-server (b11434, the [llamacpp] extra) on Spec-Bench, one
# interleaved `specdecode bench` (issue 22): plain decoding compiled, EAGLE-3 compiled at auto's shape, a
# top-2 tree (2/2/5) and a chain of one, and llama-server plain, the same GGUF, 2 threads, 128 tokens.
# The graphs its prompts need are built (or loaded) before timing. Stop data generation first.
# Writes $OUT/run.json and run.txt (default OUT=benchmarks/results/compiled-vs-llamacpp).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/compiled-vs-llamacpp}
mkdir -p "$OUT"
.venv/bin/specdecode bench --methods \
    "baseline:compile=on,eagle3:compile=on,eagle3:steps=2,topk=2,draft_tokens=5,compile=on,eagle3:steps=1,topk=1,compile=on,llamaserver" \
    --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 --max-new-tokens 128 --threads 2 \
    --out "$OUT/run.json" | tee "$OUT/run.txt"
