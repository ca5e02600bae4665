#!/usr/bin/env bash
# Engine speed, per weight format and dtype, and against llama.cpp on the same GGUF.
# One benchmark at a time (2-core machine). Writes benchmarks/results/engine/.
#   1. `formats`: ms per target forward over k = 1..32 tokens (decode step and verify-cost curve),
#      held-out perplexity (24 PubMedQA passages) and greedy agreement (Spec-Bench, 1 per category),
#      each format with the measured kernel plan (`--kernels auto`) and the static rules (`:static`).
#   2. `bench`: our baseline and default EAGLE-3 in bf16 and llama.cpp (llama-cpp-python,
#      `pip install 'specdecode[llamacpp]'`), Spec-Bench 2 per category x 128 tokens, greedy,
#      interleaved, with the op-time breakdown of the baseline: once per weight format (q4: the
#      GGUF's own 4-bit blocks; int8; native bf16).
#   3. `bench`: our fp32 baseline against transformers fp32 (the `hf` method), same prompts.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results/engine
mkdir -p "$R"
rm -f "$R"/*.jsonl
export COLUMNS=200
SPEC=../shared/data/spec_bench_questions.jsonl
THREADS=${THREADS:-2}

run() {  # run NAME CMD...: the command line, then its output, into $R/NAME.txt
  local name=$1; shift
  { echo "\$ $*"; "$@"; } 2>&1 | tee "$R/$name.txt"
}

run formats $SD formats --threads "$THREADS" --formats float32:native,float32:native:static,bfloat16:native,bfloat16:native:static,bfloat16:int8,bfloat16:int8:static,bfloat16:q4,bfloat16:q4:static \
    --passages ../shared/data/prompts/long/pubmedqa__pubmedqa.jsonl --num-passages 24 \
    --prompts "$SPEC" --per-category 1 --max-new-tokens 64 --out "$R/formats.json"
METHODS=baseline,eagle3,llamacpp
python_has_llamacpp=$(.venv/bin/python -c "import llama_cpp" 2>/dev/null && echo yes || echo no)
[ "$python_has_llamacpp" = yes ] || METHODS=baseline,eagle3
for weights in q4 int8 native; do
  run "bench-bf16-$weights" $SD bench --methods "$METHODS" --dtype bfloat16 --weights "$weights" --threads "$THREADS" \
      --prompts "$SPEC" --per-category 2 --max-new-tokens 128 --warmup 1 --op-profile --no-store \
      --out "$R/bench-bf16-$weights.jsonl"
done
run bench-fp32-hf $SD bench --methods baseline,hf --dtype float32 --threads "$THREADS" \
    --prompts "$SPEC" --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$R/bench-fp32-hf.jsonl"
