#!/usr/bin/env bash
# The project's native CPU kernels, module against module (runtime.native): the default format (bf16
# activations, the GGUF's 4-bit weights), 2 threads, `specdecode formats` (ms per target forward over k
# tokens: k=1 a decode step, k=3/5 verifies) with the measured kernel plan, once per setting of
# SPECDECODE_NATIVE, alternated ROUNDS times (this machine's speed drifts: compare settings within a round).
# Settings (SETTINGS, space-separated): 1 = every module this CPU runs (AVX-512 VNNI where it has it),
# avx2 = the AVX2 module only, avx2,avx512 = the linear kernels without the attention module, 0 = aten's
# kernels only. CONTEXT: cached tokens before each timed forward (default: formats' own). Each setting has its own kernel plan (the plan's
# key records the candidates), measured at its first load.
# Writes $OUT/native-<setting>-<round>.json (default OUT=benchmarks/results/native-kernels) and prints
# the median per setting and k, and each setting's ratio to the first.
set -euo pipefail
cd "$(dirname "$0")/../.."
SD=.venv/bin/specdecode
R=${OUT:-benchmarks/results/native-kernels}
ROUNDS=${ROUNDS:-3}
REPEATS=${REPEATS:-30}
CONTEXT_ARGS=()
[ -n "${CONTEXT:-}" ] && CONTEXT_ARGS=(--context "$CONTEXT")
SETTINGS=${SETTINGS:-"avx2 1 0"}
mkdir -p "$R"
export COLUMNS=160
for round in $(seq 1 "$ROUNDS"); do
  for setting in $SETTINGS; do
    echo "== round $round, SPECDECODE_NATIVE=$setting"
    SPECDECODE_NATIVE=$setting $SD formats --threads 2 --formats bfloat16:q4:auto --ks 1,3,5 --repeats "$REPEATS" "${CONTEXT_ARGS[@]}" \
        --max-new-tokens 16 --out "$R/native-$setting-$round.json" 2>&1 | grep -v -E "Warning|warn_once" \
        | tee "$R/native-$setting-$round.txt"
  done
done
.venv/bin/python - "$R" $SETTINGS <<'EOF'
import json, statistics, sys
from pathlib import Path
out, settings = Path(sys.argv[1]), sys.argv[2:]
runs = {s: [json.loads(p.read_text())["rows"][0] for p in sorted(out.glob(f"native-{s}-*.json"))] for s in settings}
ks = list(runs[settings[0]][0]["forward_ms"])
med = {s: {k: statistics.median(r["forward_ms"][k] for r in rows) for k in ks} for s, rows in runs.items()}
print(f"median ms per forward over k tokens ({len(runs[settings[0]])} rounds), ratio to SPECDECODE_NATIVE={settings[0]}")
print("setting".ljust(10) + "".join(f"k={k}".rjust(18) for k in ks))
for s in settings:
    print(s.ljust(10) + "".join(f"{med[s][k]:8.2f} ({med[settings[0]][k] / med[s][k]:.2f}x)".rjust(18) for k in ks))
for s in settings:
    print(f"plan {s}: {runs[s][0]['kernels'].get('choices')}")
(out / "summary.json").write_text(json.dumps({"median_forward_ms": med, "rounds": len(runs[settings[0]])}, indent=1))
EOF
