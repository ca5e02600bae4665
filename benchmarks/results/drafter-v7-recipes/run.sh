#!/usr/bin/env bash
# Drafter v7 recipe levers (issue 53 item 1), one lever per run, on the CPU: each run continues the shipped v6 over the
# answers data v5 gained after v6 was trained (--skip-samples 19331), same data, steps, seed and schedule as the
# control; only the named lever differs. Held-out chain 3 (128 answers, as every drafter since v4) and the unseen set
# every 150 steps. Usage: run.sh NAME [extra train flags...], e.g. run.sh control; run.sh tv --tv-weight 0.9
set -euo pipefail
cd "$(dirname "$0")/../../.."  # the repository root
name=$1; shift
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v5 --out "runs/v7-recipes/$name" --device cpu \
  --threads 2 --draft-vocab-size 8192 --ttt-steps 3 --lr 2e-4 --batch-tokens 2048 --max-steps 450 --skip-samples 19331 \
  --eval-every 150 --eval-samples 128 --eval-data datasets/smollm2-135m-unseen-v1 --save-every 50 --patience 0 \
  --select best --seed 0 --init-from specdecode/drafters/smollm2-135m-instruct-eagle3 "$@"
