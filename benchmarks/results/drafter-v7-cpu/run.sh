#!/usr/bin/env bash
# Drafter v7 candidate (issue 25, session 21, on the 2-core CPU): the shipped v6 continued over only the answers data
# v5 gained after v6 was trained (--skip-samples 19331: v6 saw the first 19,331 training samples of the set at 20,352
# samples; 16,891 later ones train, 211 of them left out by --max-len), a fresh cosine schedule at 2e-4 peak, 2048-token
# batches (v6's GPU runs used 16,384), 900 steps (0.35 epoch of the new answers), held-out chain 3 every 300 steps on
# the same 128 answers as every table of the model card. 3597 s in all, about 3.1 s a typical step
# (evaluations excluded), target online.
# Result (evals.json): 2.320 (v6, step 0), 2.284, 2.307, 2.311: no gain; --select best kept v6's weights.
cd "$(dirname "$0")/../../.."  # the repository root
exec .venv/bin/specdecode train --data datasets/smollm2-135m-corpus-v5 --out "${OUT:-runs/drafter-v7}" --device cpu \
  --threads 2 --draft-vocab-size 8192 --ttt-steps 3 --lr 2e-4 --batch-tokens 2048 --max-steps 900 --skip-samples 19331 \
  --eval-every 300 --eval-samples 128 --save-every 50 --patience 0 --select best \
  --init-from specdecode/drafters/smollm2-135m-instruct-eagle3
