#!/usr/bin/env bash
# The old code: OLD=/tmp/wt-old after `git worktree add /tmp/wt-old b9ca8be`. Results: benchmarks/results/batch-first-cycle/
# (first-run/: eager only, before the cycle overhead fixes of 08a4d54). Data generation was paused for both.
# eager regression check of the batch-first cycle: new (main) vs old (b9ca8be) code, same methods
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
M="baseline:compile=off,eagle3:steps=1,topk=1,spec=static,compile=off,baseline:compile=on,eagle3:steps=1,topk=1,spec=static,compile=on"
SPEC=$ROOT/../shared/data/spec_bench_questions.jsonl
for side in new old; do
  dir=$ROOT; [ $side = old ] && dir=${OLD:-/tmp/wt-old}
  (cd $dir && $ROOT/.venv/bin/python -m specdecode bench --prompts $SPEC --per-category 1 --max-new-tokens 128 \
     --warmup 1 --threads 2 --compile off --no-store --out $ROOT/benchmarks/results/batch-first-cycle/$side.json --methods "$M" 2>&1 \
     | grep -v -E "Warning|warn_once" > $ROOT/benchmarks/results/batch-first-cycle/$side.txt)
done
