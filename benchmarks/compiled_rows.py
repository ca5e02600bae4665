"""Compiled against eager at many rows (issue 22): ms per B-row decode step (1 token per row, CONTEXT of the
256 slots cached), the stored graph against the same padded step run eager, alternated ROUNDS times in one
process, the default format. What decides ``core.quant.GRAPH_FOLD_MIN_ROWS`` (from how many rows a graph
folds a quantized layer's dequantized weight in) and whether a batch job (data build) gains from compiling.

    .venv/bin/python benchmarks/compiled_rows.py [--rows 16,32,128] [--rounds 3] [--calls 5] [--out FILE]

Prints the table and writes JSON with the environment fingerprint (default
benchmarks/results/compiled-rows/rows.json). Graphs come from (or go to) the graph store."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.bench.fingerprint import capture
from specdecode.core.compiled import CompiledSteps, _dummy_inputs, configure_inductor
from specdecode.runtime.compiling import PackageStore
from specdecode.runtime.session import RuntimeConfig, start

CONTEXT, SPAN = 200, 256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,32,128", help="row counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="timed calls per setting and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled-rows/rows.json"))
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    session = start(RuntimeConfig(threads=args.threads, compile="off"))
    model = session.loaded.model
    configure_inductor(model.device.type)
    settings = {
        "compiled": CompiledSteps(store=PackageStore(), on_compile=lambda key, s: print(
            f"building {key} ..." if s is None else f"built in {s:.0f} s", file=sys.stderr)),
        "eager": CompiledSteps(compile=False),  # the same padded step, the plan's kernels, no graph
    }
    ms: dict[int, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for B in rows:
            cache = model.new_cache(B, SPAN)
            tokens, positions, slots, mask = _dummy_inputs(B, 1, SPAN, model.device)
            positions, slots = positions + CONTEXT, slots + CONTEXT
            mask[..., :CONTEXT + 1] = True
            settings["compiled"](model, tokens, positions, slots, mask, cache, ())  # build or load
            ms[B] = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name, steps in settings.items():
                    for _ in range(2):
                        steps(model, tokens, positions, slots, mask, cache, ())
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        steps(model, tokens, positions, slots, mask, cache, ())
                    ms[B][name].append((time.perf_counter() - t) / args.calls * 1e3)
    print(f"{SPAN} slots, {CONTEXT} cached, {args.threads} threads, median of {args.rounds} alternated rounds")
    print("rows   compiled ms   eager ms   compiled / eager")
    for B in rows:
        c, e = statistics.median(ms[B]["compiled"]), statistics.median(ms[B]["eager"])
        print(f"{B:>4} {c:>13.1f} {e:>10.1f} {c / e:>12.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = capture(threads=session.threads, dtype=session.dtype_name, device=str(session.device),
                          weights=session.config.weights, kernels=session.kernels.summary(), compiled="stored graphs")
    args.out.write_text(json.dumps({"span": SPAN, "context": CONTEXT, "rounds": args.rounds,
                                    "ms": {str(B): v for B, v in ms.items()}, "fingerprint": fingerprint}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
