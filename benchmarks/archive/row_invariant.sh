#!/usr/bin/env bash
# The row-invariant integer kernels (issue 47), eager, the default format (bf16 activations, the GGUF's 4-bit
# weights), 2 threads:
#   1. `specdecode formats`: ms per target forward over k = 1, 2, 4, 8, 16 tokens (the verify curve), held-out
#      perplexity (24 PubMedQA passages) and greedy agreement with bf16 native (Spec-Bench, 1 per category),
#      for int8 and int16 activations;
#   2. the same curve with the earlier kernel family (SPECDECODE_NATIVE without the rows module), alternated
#      with the new one ROUNDS times (compare within a round: this machine's speed drifts);
#   3. `bench --methods baseline,eagle3` (auto shape) on Spec-Bench, 2 per category x 128 tokens: does speculation
#      pay now, and is greedy speculative output plain decoding's (the bench's lossless column).
# Writes $OUT/ (default benchmarks/results/row-invariant/): formats.json, curve-<setting>-<round>.json,
# bench.jsonl and the printed tables.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=${OUT:-benchmarks/results/row-invariant}
DATA=${DATA:-../shared/data}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
STEPS=${STEPS:-"formats curve bench"}
mkdir -p "$R"
export COLUMNS=160

run() {  # run NAME CMD...: the command line, then its output, into $R/NAME.txt
  local name=$1; shift
  { echo "\$ $*"; "$@"; } 2>&1 | grep -v -E "Warning|warn_once" | tee "$R/$name.txt"
}

if [[ " $STEPS " == *" formats "* ]]; then
  run formats $SD formats --threads "$THREADS" --formats bfloat16:native,bfloat16:q4:auto:int16,bfloat16:q4:auto:int8 \
      --ks 1,2,4,8,16 --passages "$DATA/prompts/long/pubmedqa__pubmedqa.jsonl" --num-passages 24 \
      --prompts "$DATA/spec_bench_questions.jsonl" --per-category 1 --max-new-tokens 64 --out "$R/formats.json"
fi
if [[ " $STEPS " == *" curve "* ]]; then
  for round in $(seq 1 "$ROUNDS"); do
    for setting in 1 avx2,avx512,attention; do
      run "curve-${setting//,/+}-$round" env SPECDECODE_NATIVE=$setting $SD formats --threads "$THREADS" \
          --formats bfloat16:q4 --ks 1,2,4,8,16 --repeats 15 --max-new-tokens 8 --num-prompts 1 \
          --out "$R/curve-${setting//,/+}-$round.json"
    done
  done
fi
if [[ " $STEPS " == *" bench "* ]]; then
  run bench $SD bench --methods baseline,eagle3 --threads "$THREADS" --prompts "$DATA/spec_bench_questions.jsonl" \
      --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench.jsonl"
fi
