#!/usr/bin/env bash
# drafter v6 candidate (issue 25): the shipped v5 continued on the same v4 data, a fresh cosine schedule at a lower
# peak (3e-4; v5's 5e-4 peak first cost 0.03 of held-out accept length), to see whether the curve keeps rising
set -euo pipefail
# Session 13 (2026-12-03): started beside a CI run, stopped at step 300 of 1400 (checkpoint in runs/drafter-v6 on that
# machine; the same command resumes it) to leave the CPU to CI; no evaluation past step 0 (2.19, v5 as shipped).
cd "$(dirname "$0")/../../../.."  # the repository root
# --init-from reads drafter v5 (the package's drafter at commit b3155ab)
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v4 --out runs/drafter-v6 --device cpu --threads 2 \
  --draft-vocab-size 8192 --ttt-steps 3 --lr 3e-4 --batch-tokens 2048 --max-steps "${MAX_STEPS:-1400}" \
  --eval-every "${EVAL_EVERY:-350}" --eval-samples 128 --save-every 50 --patience 0 --select best \
  --feature-cache runs/features-v4 --init-from specdecode/drafters/smollm2-135m-instruct-eagle3
