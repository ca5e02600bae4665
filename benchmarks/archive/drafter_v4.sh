#!/usr/bin/env bash
# Drafter v4 against v3 (issue 25): benchmarks/archive/drafter_compare.sh with v3 from git history (the last
# commit that shipped it) and v4 as shipped. Results: benchmarks/results/drafter-v4/.
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${V3:-runs/drafter-v3} OLD_COMMIT=${V3_COMMIT:-17aa3aa} NEW=${V4:-specdecode/drafters/smollm2-135m-instruct-eagle3} \
    OUT=benchmarks/results/drafter-v4 DATA=${DATA:-datasets/smollm2-135m-corpus-v4} exec benchmarks/archive/drafter_compare.sh
