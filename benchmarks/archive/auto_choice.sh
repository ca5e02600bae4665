#!/usr/bin/env bash
# Does `--spec-config auto` (the default of every command) choose well here? (issue 22) On this machine, two
# threads, eager steps, the shipped drafter, for each bf16 weight format (native; q4: the GGUF's own 4-bit blocks):
#   1. CALIBRATIONS fresh calibrations (default 3): `generate --json`, the cycle costs measured anew each time (the
#      cached file it names is removed after each): the shape chosen and its predicted speedup, so a reader sees
#      how far the choice moves with the machine's noise;
#   2. one interleaved `bench` on Spec-Bench (2 prompts per category = 26, 128 tokens): the baseline, `eagle3`
#      (auto, from a last calibration kept for the run), the static default (2 steps, top-2, 5 tokens) and the
#      shapes in SHAPES_<format> (chains auto chose before on machines like this), with the cost model's
#      prediction beside the measured speedup for auto.
# Writes $OUT (default benchmarks/results/auto-choice). A step whose result file exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=${OUT:-benchmarks/results/auto-choice}
SPEC=../shared/data/spec_bench_questions.jsonl
CALIBRATIONS=${CALIBRATIONS:-3}
SHAPES_native=${SHAPES_native:-"steps=4,topk=1 steps=2,topk=1"}
SHAPES_q4=${SHAPES_q4:-"steps=1,topk=1 steps=2,topk=1"}
mkdir -p "$R"
export COLUMNS=200
for W in ${FORMATS:-native q4}; do
    if [ ! -s "$R/choices-$W.jsonl" ]; then
        for i in $(seq 1 "$CALIBRATIONS"); do
            $SD generate "Hi" --json --max-new-tokens 4 --dtype bfloat16 --weights "$W" --threads 2 --compile off \
                | .venv/bin/python -c "
import json, os, sys
r = json.load(sys.stdin)
c = r['spec_choice']
print(json.dumps({'calibration': $i, 'shape': [c['num_steps'], c['topk'], c['num_draft_tokens']],
                  'predicted_speedup': c.get('predicted_speedup'), 'costs': c.get('costs'),
                  'candidates': c.get('candidates')}))
path = (c.get('costs') or '').rpartition('cached in ')[2]
if path and os.path.exists(path): os.remove(path)  # the next calibration measures anew
"
        done > "$R/choices-$W.jsonl.tmp"
        mv "$R/choices-$W.jsonl.tmp" "$R/choices-$W.jsonl"
    fi
    M="baseline,eagle3,eagle3:steps=2,topk=2,draft_tokens=5"
    eval "extra=\$SHAPES_$W"
    for s in $extra; do M="$M,eagle3:$s"; done
    [ -s "$R/bench-$W.json" ] || $SD bench --prompts "$SPEC" --per-category 2 --max-new-tokens 128 --warmup 1 \
        --dtype bfloat16 --weights "$W" --threads 2 --compile off --no-store --out "$R/bench-$W.json" \
        --methods "$M" 2>&1 | grep -v -E "Warning|warn_once" | tee "$R/bench-$W.txt"
done
.venv/bin/python - "$R" <<'EOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("choices-*.jsonl")):
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    print(p.stem, "; ".join(f"{'/'.join(map(str, r['shape']))} predicted {r['predicted_speedup']}x" for r in rows))
EOF
