#!/usr/bin/env bash
# Compiled steps (issue 22, `--compile`) on this machine, 2 threads, the default format (bf16 activations,
# the GGUF's own 4-bit weights):
#   1. one interleaved `bench` on Spec-Bench (1 prompt per category = 13 prompts, 128 tokens): the baseline eager
#      and compiled, EAGLE-3 chain of 1 (the shape `--spec-config auto` chooses at q4 here) eager and compiled, and
#      llama.cpp (llama-cpp-python) when it is installed. Inductor's cache starts empty (SPECDECODE_CACHE=$COLD),
#      so the compile notices in bench.txt give cold compile times;
#   2. the same bench again on the now warm cache, 3 prompts x 32 tokens: warm compile (load) times;
#   3. `check --compile on` in float32: greedy speculative output against the baseline, both compiled.
# bench compiles every graph the prompts need before timing (CompiledSteps.warm): one per cache size (a power of
# two from 256) and kind (decode; verify; the drafter's re-extend per token bucket).
# On CPU the graphs are AOTInductor packages kept in $COLD/graphs (runtime.compiling.PackageStore): step 2 loads them.
# A step whose result file exists is skipped: delete it to measure again. OUT names the results directory (one
# per machine; default benchmarks/results/compiled).
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=${OUT:-benchmarks/results/compiled}
SPEC=../shared/data/spec_bench_questions.jsonl
COLD=runs/compiled-cache
mkdir -p "$R"
M="baseline:compile=off,baseline:compile=on,eagle3:steps=1,topk=1,spec=static,compile=off"
M="$M,eagle3:steps=1,topk=1,spec=static,compile=on"
.venv/bin/python -c "import llama_cpp" 2>/dev/null && M="$M,llamacpp"
if [ ! -s "$R/bench.json" ]; then
    rm -rf "$COLD"
    SPECDECODE_CACHE=$COLD $SD bench --prompts "$SPEC" --per-category 1 --max-new-tokens 128 --warmup 1 \
        --threads 2 --compile off --no-store --out "$R/bench.json" --methods "$M" 2>&1 \
        | grep -v -E "Warning|warn_once" | tee "$R/bench.txt"
fi
[ -s "$R/bench-warm.json" ] || SPECDECODE_CACHE=$COLD $SD bench --prompts "$SPEC" --num-prompts 3 \
    --max-new-tokens 32 --warmup 1 --threads 2 --compile off --no-store --out "$R/bench-warm.json" --methods "$M" 2>&1 \
    | grep -v -E "Warning|warn_once" | tee "$R/bench-warm.txt"
# 3. losslessness with compiled steps: `check --compile on` (float32, native weights, its default), EAGLE-3
#    chain of 2 against the baseline, both compiled, Spec-Bench 1 per category x 64 tokens.
[ -s "$R/check-fp32-compiled.json" ] || SPECDECODE_CACHE=$COLD $SD check --compile on --threads 2 --prompts "$SPEC" \
    --per-category 1 --max-new-tokens 64 --num-steps 2 --topk 1 --out "$R/check-fp32-compiled.json" 2>&1 \
    | grep -v -E "Warning|warn_once" | tee "$R/check-fp32-compiled.txt"
