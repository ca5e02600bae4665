#!/usr/bin/env bash
# drafter v6 candidate (issue 25): the shipped v5 continued on the same v4 data, a fresh cosine schedule at a lower
# peak (3e-4; v5's 5e-4 peak first cost 0.03 of held-out accept length), to see whether the curve keeps rising
set -euo pipefail
# Session 13 (2026-12-03): started from the feature store beside a CI run, stopped at step 300 of 1400, never
# evaluated. Session 18 (2026-12-04): run again with the target online (no --feature-cache): a session on a new
# machine has no store, building one costs ~100 minutes, and less than one epoch fits in a session (measured
# here: 3.76 s a step online, 2.5 s of it the target's forward, against ~2 s from a store). The same command
# resumes from runs/drafter-v6/checkpoint. Session 18 ran it twice side by side, one thread each, the same data
# order and schedule: OUT=runs/drafter-v6 (as v5 was trained) and OUT=runs/drafter-v6-align ALIGN_TOPK=2
# (GRIFFIN's token-alignable loss, issue 25's recipe question), MAX_STEPS=650 EVAL_EVERY=325.
cd "$(dirname "$0")/../../../.."  # the repository root
# --init-from reads drafter v5 (the package's drafter at commit b3155ab)
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v4 --out "${OUT:-runs/drafter-v6}" --device cpu --threads "${THREADS:-2}" \
  --draft-vocab-size 8192 --ttt-steps 3 --lr 3e-4 --batch-tokens 2048 --max-steps "${MAX_STEPS:-1400}" \
  --eval-every "${EVAL_EVERY:-350}" --eval-samples 128 --save-every 50 --patience 0 --select best \
  --align-topk "${ALIGN_TOPK:-0}" --init-from specdecode/drafters/smollm2-135m-instruct-eagle3
