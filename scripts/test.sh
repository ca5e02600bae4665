#!/usr/bin/env bash
# Set up (if needed), check the architecture and the code, and run the whole test suite.
# This is what CI runs (.ci/run). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== import layers (import-linter; imports inside functions included)"
.venv/bin/lint-imports
echo "== ruff"
.venv/bin/ruff check specdecode tests benchmarks
echo "== mypy (strict on specdecode.core)"
.venv/bin/mypy
echo "== tests"
# the slowest tests in every log: CI must stay under 30 minutes on a 2-core machine
exec .venv/bin/python -m pytest -q --durations=20 "$@"
