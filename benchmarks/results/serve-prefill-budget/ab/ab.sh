#!/usr/bin/env bash
# same-run A/B: one chunk per step (cc65c86) vs the prefill budget (ad032e0); c=1 then c=4, 2 rounds, opposite order
set -u
PORT=8771
SD_BENCH=/work/main/.venv/bin/specdecode
run_one() {  # NAME DIR ROUND
    (cd "$2" && .venv/bin/python -m specdecode serve --threads 2 --max-running-requests 4 --context-length 1024 --port $PORT > /tmp/ab/server-$1-r$3.log 2>&1) &
    local pid=$!
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
    for c in 1 4; do
        (cd /work/main && $SD_BENCH bench --endpoint "http://127.0.0.1:$PORT" --concurrency $c --api chat --warmup 1 --no-store \
            --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 --max-new-tokens 128 \
            --out /tmp/ab/$1-r$3-c$c.json > /tmp/ab/$1-r$3-c$c.txt 2>&1)
    done
    pkill -TERM -f "specdecode serve --threads 2 --max-running-requests 4 --context-length 1024 --port $PORT"; wait $pid
}
run_one onechunk /work/wt-old 1
run_one budget /work/main 1
run_one budget /work/main 2
run_one onechunk /work/wt-old 2
echo done
