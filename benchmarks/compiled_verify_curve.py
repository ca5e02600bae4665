"""Compiled verify cost (issue 22): ms per stored-graph target forward over T = 1, 2, 4, 8 tokens of one row,
the default format, over a cache of SPAN slots (200 of them holding context), the T-buckets alternated
ROUNDS times in one process (this machine's speed drifts). What a speculative shape costs once compiled:
the input auto's cost model lacks (it calibrates eager cycles). Graphs come from (or go to) the graph store.

    .venv/bin/python benchmarks/compiled_verify_curve.py [--span 256] [--rounds 5] [--calls 50] [--out FILE]

Prints the table and writes JSON with the environment fingerprint (default
benchmarks/results/compiled-verify/curve.json)."""

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

TOKENS = (1, 2, 4, 8)
CONTEXT = 200


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--span", type=int, default=256, help="cache slots a graph attends over")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50, help="timed calls per bucket and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled-verify/curve.json"))
    args = p.parse_args()
    if args.span <= CONTEXT + max(TOKENS):
        p.error(f"--span must exceed {CONTEXT + max(TOKENS)} (the context plus the largest verify)")
    session = start(RuntimeConfig(threads=args.threads, compile="off"))
    model = session.loaded.model
    configure_inductor(model.device.type)
    steps = CompiledSteps(store=PackageStore(), on_compile=lambda key, s: print(
        f"building {key} ..." if s is None else f"built in {s:.0f} s", file=sys.stderr))
    cache = model.new_cache(1, args.span)
    calls = {}
    with torch.inference_mode():
        for T in TOKENS:  # T tokens at positions CONTEXT.., each seeing the context and itself causally
            tokens, positions, slots, mask = _dummy_inputs(1, T, args.span, model.device)
            positions, slots = positions + CONTEXT, slots + CONTEXT
            mask[..., :CONTEXT + T] = torch.ones(T, CONTEXT + T, dtype=torch.bool).tril(CONTEXT)
            calls[T] = (tokens, positions, slots, mask)
            steps(model, *calls[T], cache, ())
        ms: dict[int, list[float]] = {T: [] for T in TOKENS}
        for _ in range(args.rounds):
            for T, inputs in calls.items():
                for _ in range(3):
                    steps(model, *inputs, cache, ())
                t = time.perf_counter()
                for _ in range(args.calls):
                    steps(model, *inputs, cache, ())
                ms[T].append((time.perf_counter() - t) / args.calls * 1e3)
    median = {T: statistics.median(v) for T, v in ms.items()}
    print(f"stored-graph target forward, {args.span} slots, {CONTEXT} cached, {args.threads} threads, "
          f"median of {args.rounds} alternated rounds")
    print("tokens        ms   vs T=1   rounds")
    for T in TOKENS:
        print(f"{T:>6} {median[T]:>9.2f} {median[T] / median[1]:>7.2f}x   "
              + " ".join(f"{x:.2f}" for x in ms[T]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = capture(threads=session.threads, dtype=session.dtype_name, device=str(session.device),
                          weights=session.config.weights, kernels=session.kernels.summary(), compiled="stored graphs")
    args.out.write_text(json.dumps({"span": args.span, "context": CONTEXT, "rounds": args.rounds,
                                    "ms": {str(T): v for T, v in ms.items()},
                                    "median_ms": {str(T): m for T, m in median.items()},
                                    "fingerprint": fingerprint}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
