#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model: SmolLM2-135M-Instruct with the shipped
# EAGLE-3 drafter, answering a chat prompt with the per-phase profile. Nothing but the prompt is given: the format
# (bf16 with the GGUF's own 4-bit weights where the CPU has bf16) and the speculative shape are the defaults, chosen
# by measuring this machine (README: "Defaults chosen by measurement"). Later flags override them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/specdecode generate "${1:-Explain in a few sentences why the sky is blue.}" --profile "${@:2}"
