#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/specdecode generate "${@:-Explain in a few sentences why the sky is blue.}"
