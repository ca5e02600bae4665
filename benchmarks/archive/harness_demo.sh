#!/usr/bin/env bash
# The runs behind the bench/server/tensor-parallel figures in the closing notes and README.
# One benchmark at a time (2-core machine). Writes benchmarks/results/harness/.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=benchmarks/results/harness
mkdir -p "$R"
export SPECDECODE_RESULTS_DB="$R/results.db"
rm -f "$R"/*.jsonl "$SPECDECODE_RESULTS_DB"
unset SPECDECODE_THREADS

# 1. the hidden-variable trap: the same bench, OMP_NUM_THREADS=2 then 1; compare must name it first
COMMON=(--methods baseline --num-prompts 8 --max-new-tokens 64 --dtype bfloat16 --warmup 1)
OMP_NUM_THREADS=2 $SD bench "${COMMON[@]}" --out "$R/threads-2.jsonl" | tee "$R/threads-2.txt"
OMP_NUM_THREADS=1 $SD bench "${COMMON[@]}" --out "$R/threads-1.jsonl" | tee "$R/threads-1.txt"
$SD compare "$R/threads-2.jsonl" "$R/threads-1.jsonl" | tee "$R/compare-threads.txt"
$SD report "$R/threads-2.jsonl" "$R/threads-1.jsonl" --out "$R/report.md"

# 2. our server, measured by remote mode (shipped drafter, bf16)
$SD serve --dtype bfloat16 --port 8765 > "$R/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 1; done
$SD bench --endpoint http://127.0.0.1:8765 --num-prompts 8 --max-new-tokens 64 --warmup 1 \
    --out "$R/remote-c1.jsonl" | tee "$R/remote-c1.txt"
$SD bench --endpoint http://127.0.0.1:8765 --num-prompts 8 --max-new-tokens 64 --warmup 0 --concurrency 4 \
    --out "$R/remote-c4.jsonl" | tee "$R/remote-c4.txt"
.venv/bin/python benchmarks/tools/load_test.py --url http://127.0.0.1:8765 --clients 4 --requests 2 --max-tokens 32 \
    --out "$R/load-test.json" | tee "$R/load-test.txt"
curl -s http://127.0.0.1:8765/metrics | grep -E '^specdecode_(spec|generation|requests_total)' > "$R/metrics-after.txt"
kill $SERVER; wait $SERVER 2>/dev/null || true
trap - EXIT

# 3. tensor parallel on 2 CPU processes (gloo) against one process, fp32
TP=(--methods baseline,eagle3:steps=2 --num-prompts 4 --max-new-tokens 64 --dtype float32 --warmup 1)
$SD bench "${TP[@]}" --out "$R/tp1.jsonl" | tee "$R/tp1.txt"
$SD bench "${TP[@]}" --tp 2 --out "$R/tp2.jsonl" | tee "$R/tp2.txt"
$SD generate "Write a haiku about the sea." --tp 2 --max-new-tokens 48 --profile 2>&1 | tee "$R/tp2-profile.txt"
$SD comm-bench --world 2 --out "$R/comm-bench.jsonl" | tee "$R/comm-bench.txt"
