#!/usr/bin/env bash
# Serving overhead per token: our server (bf16, no speculation) measured over HTTP as the
# `served` method of one local bench, interleaved prompt by prompt with the in-process baseline,
# the same token ids, the same threads. Writes benchmarks/results/server-overhead.{txt,jsonl}.
#   benchmarks/archive/server_overhead.sh [extra bench flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results
PORT=${PORT:-8766}
THREADS=${THREADS:-2}
rm -f "$R/server-overhead.jsonl"
$SD serve --dtype bfloat16 --no-spec --threads "$THREADS" --port "$PORT" --log-interval 3600 > /tmp/server-overhead.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
CMD=($SD bench --methods "baseline,served:url=http://127.0.0.1:$PORT" --dtype bfloat16 --threads "$THREADS"
     --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 --max-new-tokens 128 --runs 2 --warmup 1
     --no-store --out "$R/server-overhead.jsonl" "$@")
{ echo "\$ ${CMD[*]}"; COLUMNS=160 "${CMD[@]}"; } 2>&1 | tee "$R/server-overhead.txt"
