#!/usr/bin/env bash
# drafter v4, second pass: the shipped v4 continued on the same data (a fresh cosine schedule over ~1 epoch)
set -euo pipefail
cd "$(dirname "$0")/../../../.."  # the repository root
# --init-from read drafter v4 (the package's drafter at commit 06da686); set to 3200 steps (eval every 800) at first, cut to 2600 (650) on resume at step 150
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v4 --out runs/drafter-v4b --device cpu --threads 2 \
  --draft-vocab-size 8192 --ttt-steps 3 --lr 5e-4 --batch-tokens 2048 --max-steps "${MAX_STEPS:-2600}" \
  --eval-every "${EVAL_EVERY:-650}" --eval-samples 128 --save-every 50 --patience 0 --select best \
  --feature-cache runs/features-v4 --init-from specdecode/drafters/smollm2-135m-instruct-eagle3
