"""Stored-graph target steps, timed (issue 22): ms per target forward of B rows x T tokens each over a cache of
SPAN slots (CONTEXT of them holding context), every (B, T) alternated ROUNDS times in one process (this machine's
speed drifts), the default format. Graphs come from (or go to) the graph store. Two questions it answers:

- a compiled verify's cost against a decode step (one row, T = 1, 2, 4, 8): what a speculative shape costs once
  compiled, the input auto's cost model calibrates;
- compiled against the same padded step run eager (``--eager``) at many rows: what decides
  ``core.quant.GRAPH_FOLD_MIN_ROWS`` (from how many rows a graph folds a quantized layer's dequantized weight in)
  and whether a batch job (data build) gains from compiling.

    .venv/bin/python benchmarks/tools/compiled_steps.py --rows 1 --tokens 1,2,4,8 --rounds 5 --calls 50 \\
        --out benchmarks/results/compiled-verify/curve.json
    .venv/bin/python benchmarks/tools/compiled_steps.py --rows 16,32,128 --tokens 1 --eager --rounds 3 --calls 5 \\
        --out benchmarks/results/compiled-rows/rows.json

Prints the table and writes JSON with the environment fingerprint."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.bench.fingerprint import capture
from specdecode.core.compiled import CompiledRunner, configure_inductor, dummy_inputs
from specdecode.core.quant import DEFAULT_ACTIVATIONS
from specdecode.runtime.graphstore import PackageStore
from specdecode.runtime.session import RuntimeConfig, start

CONTEXT = 200


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=ints, default=[1], help="rows per step, comma-separated (default 1)")
    p.add_argument("--tokens", type=ints, default=[1, 2, 4, 8], help="tokens per row, comma-separated")
    p.add_argument("--eager", action="store_true", help="also time each step eager (the same padded step, the "
                                                        "kernel plan's kernels, no graph), alternated with it")
    p.add_argument("--span", type=int, default=256, help="cache slots a graph attends over")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50, help="timed calls per step, setting and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activations", default=DEFAULT_ACTIVATIONS,
                   help="comma-separated --activations choices, each its own model and graphs, alternated (default "
                        f"{DEFAULT_ACTIVATIONS})")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled-steps/steps.json"))
    args = p.parse_args()
    if not args.rows or not args.tokens or min(args.rows + args.tokens) < 1:
        p.error("--rows and --tokens take positive counts, e.g. --rows 1,16 --tokens 1,2")
    if args.span <= CONTEXT + max(args.tokens):
        p.error(f"--span must exceed {CONTEXT + max(args.tokens)} (the context plus the most tokens)")
    acts = [a.strip() for a in args.activations.split(",") if a.strip()]
    sessions = {a: start(RuntimeConfig(threads=args.threads, compile="off", activations=a)) for a in acts}
    session = sessions[acts[0]]
    configure_inductor(session.loaded.model.device.type)
    settings = {"compiled": CompiledRunner(store=PackageStore(), on_compile=lambda key, s: print(
        f"building {key} ..." if s is None else f"built in {s:.0f} s", file=sys.stderr))}
    if args.eager:
        settings["eager"] = CompiledRunner(compile=False)
    shapes = list(itertools.product(args.rows, args.tokens))
    calls = {}
    names = [f"{name}:{a}" if len(acts) > 1 else name for a in acts for name in settings]
    ms: dict[tuple[int, int], dict[str, list[float]]] = {s: {name: [] for name in names} for s in shapes}
    with torch.inference_mode():
        for a, sess in sessions.items():
            model = sess.loaded.model
            caches = {B: model.new_cache(B, args.span) for B in args.rows}
            for B, T in shapes:  # T tokens at positions CONTEXT.., each seeing the context and itself causally
                tokens, positions, slots, mask = dummy_inputs(B, T, args.span, model.device)
                positions, slots = positions + CONTEXT, slots + CONTEXT
                mask[..., :CONTEXT + T] = torch.ones(T, CONTEXT + T, dtype=torch.bool).tril(CONTEXT)
                calls[a, B, T] = (model, {"tokens": tokens, "positions": positions, "cache": caches[B],
                                          "attention_mask": mask[:, 0], "slots": slots})
                settings["compiled"].target(model, **calls[a, B, T][1])  # build or load its graph
        for _ in range(args.rounds):
            for B, T in shapes:
                for a in acts:
                    model, inputs = calls[a, B, T]
                    for name, steps in settings.items():
                        for _ in range(2):
                            steps.target(model, **inputs)
                        t = time.perf_counter()
                        for _ in range(args.calls):
                            steps.target(model, **inputs)
                        ms[B, T][f"{name}:{a}" if len(acts) > 1 else name].append(
                            (time.perf_counter() - t) / args.calls * 1e3)
    median = {s: {name: statistics.median(v) for name, v in d.items()} for s, d in ms.items()}
    print(f"target forward, {args.span} slots, {CONTEXT} cached, {args.threads} threads, "
          f"median of {args.rounds} alternated rounds")
    for a in acts:
        def key(name: str, a: str = a) -> str:
            return f"{name}:{a}" if len(acts) > 1 else name

        print(f"activations {a}")
        print("rows tokens   compiled ms   vs 1 token" + ("   eager ms   compiled / eager" if args.eager else ""))
        for B, T in shapes:
            m = median[B, T]
            one = median.get((B, 1), {}).get(key("compiled"))
            line = f"{B:>4} {T:>6} {m[key('compiled')]:>13.2f} " + (
                f"{m[key('compiled')] / one:>11.2f}x" if one else f"{'-':>12}")
            if args.eager:
                line += f" {m[key('eager')]:>10.2f} {m[key('compiled')] / m[key('eager')]:>17.2f}x"
            print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = capture(threads=session.threads, dtype=session.dtype_name, device=str(session.device),
                          weights=session.config.weights, kernels=session.kernels.summary(), compiled="stored graphs")
    args.out.write_text(json.dumps({
        "span": args.span, "context": CONTEXT, "rounds": args.rounds, "calls": args.calls, "activations": acts,
        "steps": [{"rows": B, "tokens": T, "ms": ms[B, T], "median_ms": median[B, T]} for B, T in shapes],
        "fingerprint": fingerprint}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
