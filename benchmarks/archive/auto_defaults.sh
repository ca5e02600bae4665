#!/usr/bin/env bash
# The defaults chosen by measurement (issue 23), on this machine with two threads, Spec-Bench
# (2 prompts per category = 26 prompts; the sweep on the first of each), for each bf16 weight format (q4: the GGUF's own 4-bit
# blocks, the default here; native):
#   1. cold and warm start: `generate --json` twice on a fresh cache (the cycle-cost measuring
#      time, the choice's time on a warm cache, the shape chosen and its prediction);
#   2. `sweep` over steps 1-4 x top-k 1,2 on the first prompt of each category (13, 96 tokens): its best;
#   3. one interleaved `bench` (128 tokens): the baseline, `eagle3` (what `generate` runs by
#      default: --spec-config auto), the sweep's best, and `eagle3:adapt=1` (the shape re-chosen
#      while decoding), with the cost model's prediction beside the measured speed.
#   4. what the default format does to greedy equality with the baseline: `check --dtype auto`
#      (bf16, q4 weights, the automatic shape) on the same prompts, 64 tokens.
# A step whose result file exists is skipped: delete it to measure again.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results/auto-defaults
SPEC=../shared/data/spec_bench_questions.jsonl
mkdir -p "$R"
for W in q4 native; do
    COLD=runs/auto-defaults-cache-$W  # a fresh cache: the GGUF conversion, kernel plan and cycle costs all measured
    if [ ! -s "$R/start-$W.json" ]; then
        rm -rf "$COLD"
        for run in cold warm; do
            SPECDECODE_CACHE=$COLD $SD generate "Hi" --json --max-new-tokens 8 --dtype bfloat16 --weights "$W" \
                --threads 2 | python3 -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'run': '$run',
 'load_s': r['load_s'], 'kernels': r['kernels']['source'], 'format_reason': r['format_reason'],
 'spec_config': r['spec_config'], 'spec_choice': r['spec_choice']}))"
        done > "$R/start-$W.json"
    fi
    [ -s "$R/sweep-$W/sweep.json" ] || $SD sweep --num-steps 1,2,3,4 --topk 1,2 --prompts "$SPEC" --per-category 1 \
        --max-new-tokens 96 --dtype bfloat16 --weights "$W" --threads 2 --no-store --out "$R/sweep-$W" \
        | tee "$R/sweep-$W.txt"
    BEST=$(python3 -c "import json; print(json.load(open('$R/sweep-$W/sweep.json'))['best'])")
    [ -s "$R/bench-$W.json" ] || $SD bench --prompts "$SPEC" --per-category 2 --max-new-tokens 128 --warmup 1 \
        --dtype bfloat16 --weights "$W" --threads 2 --no-store --out "$R/bench-$W.json" \
        --methods "baseline,eagle3,$BEST,eagle3:adapt=1" | tee "$R/bench-$W.txt"
done
[ -s "$R/check-auto.json" ] || $SD check --dtype auto --threads 2 --prompts "$SPEC" --per-category 2 \
    --max-new-tokens 64 --out "$R/check-auto.json" 2>&1 | tee "$R/check-auto.txt"
