#!/usr/bin/env bash
# Continuous batching under load: `specdecode serve` (bf16, shipped drafter) measured with
# `bench --endpoint` at concurrency 1, 2, 4, 8, 16 for each --spec-policy (never, always, auto):
# total and per-request tok/s, TTFT and TPOT. One server per policy, the concurrencies run one
# after another against it. Writes benchmarks/results/serving/{POLICY}-c{N}.json and the table
# serving-concurrency.{md,json} (benchmarks/serving_table.py).
#   benchmarks/serving_concurrency.sh            # all policies and concurrencies
#   POLICIES="never" CONCURRENCY="1 4" PER_CATEGORY=1 benchmarks/serving_concurrency.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SD=.venv/bin/specdecode
R=benchmarks/results/serving
PORT=${PORT:-8767}
THREADS=${THREADS:-2}
POLICIES=${POLICIES:-"never always auto"}
CONCURRENCY=${CONCURRENCY:-"1 2 4 8 16"}
PER_CATEGORY=${PER_CATEGORY:-2}
TOKENS=${TOKENS:-128}
mkdir -p "$R"
for POLICY in $POLICIES; do
  $SD serve --dtype bfloat16 --threads "$THREADS" --port "$PORT" --spec-policy "$POLICY" \
     --max-running-requests 16 --log-interval 5 > "$R/server-$POLICY.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  for C in $CONCURRENCY; do
    rm -f "$R/$POLICY-c$C.json"
    $SD bench --endpoint "http://127.0.0.1:$PORT" --concurrency "$C" --max-new-tokens "$TOKENS" \
       --prompts ../shared/data/spec_bench_questions.jsonl --per-category "$PER_CATEGORY" --warmup 1 \
       --no-store --out "$R/$POLICY-c$C.json" > "$R/$POLICY-c$C.txt" 2>&1
    tail -n 3 "$R/$POLICY-c$C.txt"
  done
  kill -TERM $SERVER; wait $SERVER || true
done
.venv/bin/python benchmarks/serving_table.py "$R" | tee "$R/../serving-concurrency.md"
