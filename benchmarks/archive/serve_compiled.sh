#!/usr/bin/env bash
# `serve` with compiled steps (issue 22) beside `serve --compile off` and llama.cpp's llama-server, over HTTP,
# this machine, 2 threads, the default format, 4 slots each (SLOTS), 1024 tokens per request:
#   1. `specdecode compile --serve` builds the graphs serve runs with these flags (every batch size bucket up to
#      the slots, attention spans 256/512/1024, plain/verify/draft steps): compile.txt has its times and disk cost;
#   2. `bench --endpoint` (chat API, Spec-Bench 1 prompt per category = 13 prompts, 128 tokens) at concurrency 1
#      and 4 against each server, one server at a time, in two rounds of opposite order (ROUNDS) so a drift of the
#      machine weighs on every server alike; each server's startup log (server-NAME-rK.log) says how long
#      loading its graphs took;
#   3. the table (benchmarks/archive/serving_table.py: the median over rounds, total tok/s against llama-server).
# Servers (SERVERS, in this order in odd rounds): llama-server (its prompt cache on, its default), serve-eager
# (--compile off), serve-compiled (stored graphs; the prefix cache on, the default) and serve-compiled-noprefix
# (--prefix-cache-tokens 0: what the prefix cache is worth, the c=4 round repeating the prompts c=1 sent).
# Without a serve-compiled server in SERVERS nothing is compiled (e.g. SERVERS="llama-server serve-eager").
# Needs llama-server (SPECDECODE_LLAMA_SERVER=PATH, the [llamacpp] extra, or $PATH; without it that row is left
# out). Nothing else may run meanwhile (the build alone takes most of an hour on 2 cores). A step whose result
# exists is skipped: delete it (or the directory) to measure again.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=${OUT:-benchmarks/results/serve-compiled}
PORT=${PORT:-8767}
SLOTS=${SLOTS:-4}
ROUNDS=${ROUNDS:-2}
BATCH=(--threads 2 --max-running-requests "$SLOTS" --context-length 1024)
mkdir -p "$R/runs"
quiet() { grep -v -E "Warning|warn_once|warnings.warn" || true; }
read -r -a ORDER <<< "${SERVERS:-llama-server serve-eager serve-compiled serve-compiled-noprefix}"
if [[ " ${ORDER[*]} " == *" serve-compiled"* ]] && [ ! -s "$R/compile.txt" ]; then  # graphs only where served
    { time $SD compile --serve "${BATCH[@]}" --compile-max-len 1024 ; } 2>&1 | quiet | tee "$R/compile.tmp"
    mv "$R/compile.tmp" "$R/compile.txt"
fi
wait_up() {  # PORT PID: until /health answers (or the server died)
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}
start() {  # NAME LOG: start the server NAME in the background, its pid in $pid
    case $1 in
        llama-server)
            $SD launch llamacpp --no-spec --dry-run > /dev/null 2>&1 || return 1  # finds no llama-server
            $SD launch llamacpp --no-spec --parallel "$SLOTS" --threads 2 --port "$PORT" \
                --engine-args "-c $((SLOTS * 1024)) --no-webui" > "$2" 2>&1 & ;;
        serve-eager) $SD serve "${BATCH[@]}" --port "$PORT" --compile off > "$2" 2>&1 & ;;
        serve-compiled) $SD serve "${BATCH[@]}" --port "$PORT" > "$2" 2>&1 & ;;  # --compile auto: stored graphs
        serve-compiled-noprefix) $SD serve "${BATCH[@]}" --port "$PORT" --prefix-cache-tokens 0 > "$2" 2>&1 & ;;
    esac
    pid=$!
}
for round in $(seq 1 "$ROUNDS"); do
    names=("${ORDER[@]}")
    if [ $((round % 2)) = 0 ]; then names=(); for ((i = ${#ORDER[@]} - 1; i >= 0; i--)); do names+=("${ORDER[i]}"); done; fi
    for name in "${names[@]}"; do
        [ -s "$R/runs/$name-r$round-c4.json" ] && continue
        start "$name" "$R/server-$name-r$round.log" || { echo "no llama-server: $name left out"; continue; }
        if ! wait_up "$PORT" "$pid"; then
            echo "$name did not start: $R/server-$name-r$round.log"; kill "$pid" 2>/dev/null || true; exit 1
        fi
        for c in 1 4; do
            $SD bench --endpoint "http://127.0.0.1:$PORT" --concurrency "$c" --api chat --warmup 1 --no-store \
                --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 --max-new-tokens 128 \
                --out "$R/runs/$name-r$round-c$c.json" 2>&1 | quiet > "$R/runs/$name-r$round-c$c.txt"
            tail -n 2 "$R/runs/$name-r$round-c$c.txt"
        done
        kill -TERM "$pid"; wait "$pid" || true
        grep -h -E "compiled steps|spec policy auto \(" "$R/server-$name-r$round.log" || true
    done
done
.venv/bin/python benchmarks/archive/serving_table.py "$R/runs" llama-server | tee "$R/table.md"
