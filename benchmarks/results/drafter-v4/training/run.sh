#!/usr/bin/env bash
# drafter v4 this session: v3 continued on the v4 data (4x), schedule sized to the session
set -euo pipefail
cd /work/main
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v4 --out runs/drafter-v4-from-v3 --device cpu --threads 2 \
  --draft-vocab-size 8192 --ttt-steps 3 --lr 5e-4 --batch-tokens 2048 --max-steps "${MAX_STEPS:-2600}" \
  --eval-every "${EVAL_EVERY:-650}" --eval-samples 128 --save-every 50 --patience 0 --select best \
  --feature-cache runs/features-v4 --init-from specdecode/drafters/smollm2-135m-instruct-eagle3
