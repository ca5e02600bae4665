"""A speculative cycle by phase, per method of a `specdecode bench` JSON (issue 65): the mean ms a cycle of the
draft steps, the verify, the re-extend and the bookkeeping, of which host work (the cycle outside model calls),
model calls a cycle, the loop's time around the cycle, accept length, and the share of the cycle the drafter's
phases take. Means over every run, weighted by its cycles.

    .venv/bin/python benchmarks/tools/cycle_breakdown.py benchmarks/results/2026-12-07-cycle/results.json \\
        --step cycle.json --out breakdown.json

Prints the table and writes JSON (per method)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

FIELDS = ("draft", "verify", "extend", "other")


def breakdown(bench: dict) -> dict[str, dict[str, float]]:
    """Per speculative method: cycle-weighted means of the phases, host, loop and calls, and the accept length."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in bench["records"]:
        n = r.get("cycles") or 0
        if not n or "phases" not in r:
            continue
        s = sums[r["method"]]
        s["cycles"] += n
        s["tokens"] += r["accept_length"] * n
        for p in FIELDS:
            s[p] += r["phases"][p]["ms_per_cycle"] * n
        for k in ("cycle_ms", "host_ms_per_cycle", "loop_ms_per_cycle", "model_calls_per_cycle"):
            s[k] += r.get(k, 0.0) * n
    out = {}
    for method, s in sums.items():
        n = s["cycles"]
        row = {k: s[k] / n for k in (*FIELDS, "cycle_ms", "host_ms_per_cycle", "loop_ms_per_cycle",
                                     "model_calls_per_cycle")}
        row["accept_length"] = s["tokens"] / n
        row["drafter_share"] = (row["draft"] + row["extend"]) / row["cycle_ms"]
        row["cycles"] = n
        out[method] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="a `specdecode bench --out` JSON, or a result folder's results.json")
    ap.add_argument("--step", default=None, help="with a results.json: the step's file name (e.g. cycle.json)")
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()
    data = json.loads(args.bench.read_text())
    if "files" in data:  # a result folder's results.json: every step's JSON under its file name
        if args.step not in data["files"]:
            raise SystemExit(f"{args.bench}: give --step, one of {', '.join(sorted(data['files']))}")
        data = data["files"][args.step]
    rows = breakdown(data)
    head = ("method", "draft", "verify", "extend", "other", "cycle", "host", "loop", "calls", "accept", "drafter %")
    print(" | ".join(head))
    for method, r in rows.items():
        print(" | ".join([method, *(f"{r[k]:.2f}" for k in (*FIELDS, "cycle_ms", "host_ms_per_cycle",
                                                              "loop_ms_per_cycle", "model_calls_per_cycle",
                                                              "accept_length")), f"{100 * r['drafter_share']:.1f}"]))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
