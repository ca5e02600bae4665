#!/usr/bin/env bash
# One drafter against another (issues 13, 25), all on this machine with two threads, eager steps
# (--compile off: the drafters are what differs, and cold graphs would cost more than the runs).
#   OLD    the drafter to beat (a directory; with OLD_COMMIT, filled from the shipped drafter at that commit)
#   NEW    the candidate (a directory)
#   OUT    where the results go;  DATA  the data set whose held-out split measures acceptance
#   STEPS  which steps, in the order given (default: all; the table first, so auto in bf16 reads it):
#     bf16   Spec-Bench end to end, one interleaved run, bf16 native weights: the baseline, both drafters
#            at the default shape (2 steps, top-2, 5 tokens), NEW at the shape --spec-config auto chooses;
#     table  NEW's acceptance table (what --spec-config auto reads), if its directory has none yet: DATA's
#            held-out answers and the unseen-prompt set's, an equal share each;
#     check  losslessness in fp32: NEW at the default shape, speculative greedy against the baseline on
#            Spec-Bench (3 prompts per category, 64 tokens);
#     q4     Spec-Bench with the main job's weight format (bf16 + the GGUF's 4-bit weights): the
#            baseline, both drafters at one step (top-1), NEW at the default shape and at auto's;
#     eval   held-out acceptance, the trainer's estimate against the engine's measurement, both
#            drafters (chain of 3, bf16, 40 samples).
# A step whose result file exists is skipped: delete the file to measure again.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
: "${OLD:?OLD: the drafter directory to compare against}" "${NEW:?NEW: the candidate drafter directory}"
: "${OUT:?OUT: the results directory}" "${DATA:?DATA: the data set (its held-out split)}"
SPEC=../shared/data/spec_bench_questions.jsonl
RUN=(--threads 2 --compile off)
DEFAULT=steps=2,topk=2,draft_tokens=5
mkdir -p "$OUT" "$OLD"
if [ -n "${OLD_COMMIT:-}" ]; then
    for f in config.json model.safetensors acceptance.json; do
        [ -f "$OLD/$f" ] || git show "$OLD_COMMIT:specdecode/drafters/smollm2-135m-instruct-eagle3/$f" > "$OLD/$f"
    done
fi

for step in ${STEPS:-table bf16 check q4 eval}; do
    case $step in
    bf16) [ -s "$OUT/bench-specbench-bf16.json" ] || $SD bench --dtype bfloat16 "${RUN[@]}" --prompts "$SPEC" \
            --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$OUT/bench-specbench-bf16.json" \
            --methods "baseline,eagle3:$DEFAULT,drafter=$OLD,eagle3:$DEFAULT,drafter=$NEW,eagle3:drafter=$NEW" \
            | tee "$OUT/bench-specbench-bf16.txt" ;;
    table) [ -s "$NEW/acceptance.json" ] || $SD eval-drafter --data "$DATA" datasets/smollm2-135m-unseen-v1 \
            --drafter "$NEW" --acceptance-table \
            --samples "${TABLE_SAMPLES:-40}" --dtype bfloat16 --weights q4 "${RUN[@]}" ;;
    check) [ -s "$OUT/check-fp32-default.json" ] || $SD check --drafter "$NEW" --num-steps 2 --topk 2 \
            --num-draft-tokens 5 --dtype float32 "${RUN[@]}" --prompts "$SPEC" --per-category 3 --max-new-tokens 64 \
            --out "$OUT/check-fp32-default.json" 2>&1 | tee "$OUT/check-fp32-default.txt" ;;
    q4) [ -s "$OUT/bench-specbench-q4.json" ] || $SD bench --dtype bfloat16 --weights q4 "${RUN[@]}" --prompts "$SPEC" \
            --per-category 2 --max-new-tokens 128 --warmup 1 --no-store --out "$OUT/bench-specbench-q4.json" \
            --methods "baseline,eagle3:steps=1,topk=1,drafter=$OLD,eagle3:steps=1,topk=1,drafter=$NEW,eagle3:$DEFAULT,drafter=$NEW,eagle3:drafter=$NEW" \
            | tee "$OUT/bench-specbench-q4.txt" ;;
    eval) for d in old:"$OLD" new:"$NEW"; do
            [ -s "$OUT/eval-drafter-${d%%:*}-heldout.json" ] && continue
            $SD eval-drafter --data "$DATA" --drafter "${d#*:}" --depth 3 --samples 40 --dtype bfloat16 "${RUN[@]}" \
                | tee "$OUT/eval-drafter-${d%%:*}-heldout.json"
          done ;;
    *) echo "unknown step '$step' (bf16 table check q4 eval)" >&2; exit 2 ;;
    esac
done
