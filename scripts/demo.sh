#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model: SmolLM2-135M-Instruct
# with the shipped EAGLE-3 drafter, bf16 with the GGUF's 4-bit weights (--weights q4), answering a chat prompt with the per-phase profile.
# One draft step, no branching: with q4 weights a verify of several tokens costs more than in bf16, and
# benchmarks/drafter_v3.sh measured (Spec-Bench, 2 threads) 1.16x for this against 1.01x for the default
# 2 steps / top-2 / 5 tokens (the best in bf16 native: 1.41x). Later flags override these.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/specdecode generate "${1:-Explain in a few sentences why the sky is blue.}" --dtype bfloat16 --weights q4 --num-steps 1 --topk 1 --profile "${@:2}"
