#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model: SmolLM2-135M-Instruct
# with the shipped EAGLE-3 drafter, bf16 with the GGUF's 4-bit weights (--weights q4), answering a chat prompt with the per-phase profile.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/specdecode generate "${1:-Explain in a few sentences why the sky is blue.}" --dtype bfloat16 --weights q4 --profile "${@:2}"
