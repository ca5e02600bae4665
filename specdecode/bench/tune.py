"""`specdecode tune`: search a grid of environment variables, one fresh process per point.

Thread pools and NCCL read their variables at start-up, so each point runs
``specdecode bench ARGS`` in a new process with the point's environment. Points run in
rounds whose order rotates, so drift on a shared machine does not always favour the same
point; each point's score is the median over rounds of the chosen method's median tok/s.
The winner can be saved as a launch profile for ``--launch-profile NAME``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UNSET = "unset"  # a grid value meaning: the variable is absent


def parse_env_grid(items: list[str]) -> list[tuple[str, list[str | None]]]:
    """``["OMP_NUM_THREADS=1,2", "NCCL_PROTO=LL,unset"]`` -> axes of (name, values); None = unset."""
    axes = []
    for item in items:
        name, eq, values = item.partition("=")
        name = name.strip()
        if not eq or not name or not values.strip():
            raise ValueError(f"--env {item!r}: expected NAME=VALUE1,VALUE2,... (use 'unset' for an absent variable)")
        if not name.replace("_", "").isalnum():
            raise ValueError(f"--env {item!r}: {name!r} is not an environment variable name")
        if name in (n for n, _ in axes):
            raise ValueError(f"--env names {name} twice; give all its values in one --env")
        axes.append((name, [None if v.strip() == UNSET else v.strip() for v in values.split(",")]))
    return axes


def grid_points(axes: list[tuple[str, list[str | None]]]) -> list[dict[str, str | None]]:
    names = [n for n, _ in axes]
    return [dict(zip(names, combo)) for combo in itertools.product(*(v for _, v in axes))]


def point_label(point: dict[str, str | None]) -> str:
    return " ".join(f"{k}={UNSET if v is None else v}" for k, v in point.items()) or "(inherited environment)"


def point_env(point: dict[str, str | None], base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for k, v in point.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


COMMANDS = ("bench", "comm-bench")


def child_command(command: str, bench_args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "specdecode", command, *bench_args, "--out", str(out), "--no-store"]


def run_point(command: str, point: dict, bench_args: list[str], timeout_s: float) -> dict:
    """Run the command once in a fresh process with the point's environment; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run(child_command(command, bench_args, out), env=point_env(point, os.environ),
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ValueError(f"{command} failed at {point_label(point)} (exit {proc.returncode}): "
                             + " | ".join(tail))
        return json.loads(out.read_text())


def score(result: dict, method: str | None) -> tuple[str, float]:
    """(what is scored, value; higher is better): a command's own score (comm-bench: bus
    bandwidth) or a benchmarked method's median tok/s."""
    if "score" in result:
        return result["score"]["name"], result["score"]["value"]
    rows = result["summary"]
    row = rows[0] if method is None else next((r for r in rows if r["method"] == method), None)
    if row is None:
        raise ValueError(f"--method {method!r} is not among the benchmarked methods "
                         f"({', '.join(r['method'] for r in rows)})")
    return row["method"], row["tok_per_s_median"]


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--command", choices=COMMANDS, default="bench",
                   help="what each point runs: bench (score: a method's median tok/s) or comm-bench (score: mean "
                        "all-reduce bus bandwidth)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=V1,V2",
                   help="an environment axis (repeatable); 'unset' as a value means the variable is absent")
    p.add_argument("--rounds", type=int, default=2, help="passes over the grid, order rotated (default 2)")
    p.add_argument("--method", default=None, help="method whose median tok/s is the score (default: the first)")
    p.add_argument("--save-profile", default=None, metavar="NAME", help="save the best point as launch profile NAME")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per point")
    p.add_argument("--store", default=None, help="SQLite results store (default: $SPECDECODE_RESULTS_DB)")
    p.add_argument("--no-store", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environments, run nothing")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments for the command after --, e.g. -- --methods baseline --num-prompts 2")


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.profiles import LaunchProfile, save_profile

    console = Console(stderr=True)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if any(a in ("--out", "--launch-profile") or a.startswith(("--out=", "--launch-profile=")) for a in bench_args):
        raise ValueError("tune sets --out itself and tunes the environment: drop --out/--launch-profile "
                         "from the command's arguments")
    if not args.env:
        raise ValueError("give at least one --env NAME=V1,V2 axis to search")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    points = grid_points(parse_env_grid(args.env))
    if args.dry_run:
        for p in points:
            console.print(f"{point_label(p)}: {shlex.join(child_command(args.command, bench_args, Path('OUT.json')))}",
                          markup=False, highlight=False)
        return 0

    scores: dict[int, list[float]] = {i: [] for i in range(len(points))}
    children: list[dict] = []
    method = args.method
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        order = list(range(len(points)))
        k = rnd % len(points)
        for i in order[k:] + order[:k]:
            console.print(f"round {rnd + 1}/{args.rounds}: {point_label(points[i])} ...", markup=False)
            result = run_point(args.command, points[i], bench_args, args.timeout)
            method, value = score(result, method)
            scores[i].append(value)
            children.append({"method": point_label(points[i]), "run": rnd, "prompt_id": "grid",
                             "category": "tune", "tok_per_s": value, "point": points[i],
                             "fingerprint": result.get("fingerprint")})
            console.print(f"  {method}: {value:.3g}", markup=False)

    medians = {i: statistics.median(v) for i, v in scores.items()}
    best = max(medians, key=medians.get)
    table = Table(title=f"tune ({args.command}): {method}, {len(points)} points x {args.rounds} rounds, "
                        f"{time.perf_counter() - t0:.0f} s")
    for col in ("environment", "per round", "median", "vs best"):
        table.add_column(col, justify="left" if col == "environment" else "right")
    for i in sorted(medians, key=medians.get, reverse=True):
        table.add_row(point_label(points[i]), ", ".join(f"{v:.3g}" for v in scores[i]), f"{medians[i]:.3g}",
                      f"{medians[i] / medians[best]:.2f}x")
    Console(width=170).print(table)
    console.print(f"best: {point_label(points[best])} ({method} {medians[best]:.3g})", markup=False)

    summary = [{"method": point_label(points[i]), "point": points[i], "score_name": method,
                "score_median": medians[i], "score_rounds": scores[i]}
               | ({"tok_per_s_median": medians[i]} if args.command == "bench" else {}) for i in range(len(points))]
    if not args.no_store:
        from specdecode.bench.store import ResultsStore, Run, new_run_id, save_run

        fingerprint = next((c["fingerprint"] for c in children if c["fingerprint"]), {})
        run = Run(new_run_id(), "tune", time.strftime("%Y-%m-%d %H:%M:%S"), fingerprint, summary, children,
                  {"bench_args": bench_args, "best": point_label(points[best]), "method": method})
        save_run(run, ResultsStore(args.store), None, console)
    if args.save_profile:
        profile = LaunchProfile(
            args.save_profile, {k: "" if v is None else v for k, v in points[best].items()},
            f"tuned by specdecode tune --command {args.command}: {method} {medians[best]:.4g} (median over "
            f"{args.rounds} rounds), best of {len(points)} points; args: {shlex.join(bench_args)}",
            extra={"score": round(medians[best], 4)})
        console.print(f"saved launch profile {args.save_profile!r} to {save_profile(profile)}")
    return 0
