#!/usr/bin/env bash
# Continuous batching under load: `specdecode serve` (bf16, shipped drafter) measured with
# `bench --endpoint` at concurrency 1, 2, 4, 8, 16 for each --spec-policy (never, always, auto):
# total and per-request tok/s, TTFT and TPOT. One server per policy, the concurrencies run one
# after another against it. Writes benchmarks/results/serving/{POLICY}-c{N}.json and the table
# serving-concurrency.{md,json} (benchmarks/archive/serving_table.py).
#   benchmarks/archive/serving_concurrency.sh            # all policies and concurrencies
#   POLICIES="never" CONCURRENCY="1 4" PER_CATEGORY=1 benchmarks/archive/serving_concurrency.sh
# With llama-cpp-python installed (pip install '.[llamacpp]' and its server extras) its OpenAI
# server is measured the same way as the peer (PEER=0 skips it; POLICIES="" measures only it).
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results/serving
PORT=${PORT:-8767}
THREADS=${THREADS:-2}
POLICIES=${POLICIES-"never always auto"}
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
# The peer: llama-cpp-python's OpenAI server on the same GGUF and threads (one request at a time;
# --interrupt_requests False, else it cuts a running stream when another request arrives).
if [ "${PEER:-1}" = 1 ] && .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  MODEL=$(.venv/bin/python -c "from specdecode.io.paths import default_model_path; print(default_model_path())")
  .venv/bin/python -m llama_cpp.server --model "$MODEL" --n_threads "$THREADS" --n_ctx 4096 --port "$PORT" \
     --interrupt_requests False > "$R/server-llamacpp.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
  for C in $CONCURRENCY; do
    rm -f "$R/llamacpp-c$C.json"
    $SD bench --endpoint "http://127.0.0.1:$PORT" --concurrency "$C" --max-new-tokens "$TOKENS" \
       --prompts ../shared/data/spec_bench_questions.jsonl --per-category "$PER_CATEGORY" --warmup 1 \
       --no-store --out "$R/llamacpp-c$C.json" > "$R/llamacpp-c$C.txt" 2>&1 || true
    tail -n 3 "$R/llamacpp-c$C.txt"
  done
  kill -TERM $SERVER; wait $SERVER || true
fi
.venv/bin/python benchmarks/archive/serving_table.py "$R" | tee "$R/../serving-concurrency.md"
