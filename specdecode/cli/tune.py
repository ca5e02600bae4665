"""`specdecode tune`: search a grid of environment variables, one fresh process per point
(a front end to ``specdecode.bench.tune.tune``)."""

from __future__ import annotations

import argparse

from specdecode.bench.tune import COMMANDS, TuneConfig
from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args

_D = TuneConfig(env=())


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help=SUBCOMMANDS["tune"][1],
                       description="Run `specdecode bench` or `comm-bench` (arguments after --) once per point of the "
                                   "environment grid, each in a fresh process (these variables are read at start-up), "
                                   "rounds rotated against drift; report the best point and save it as a launch "
                                   "profile.")
    p.add_argument("--command", choices=COMMANDS, default=_D.command,
                   help="what each point runs: bench (score: a method's median tok/s) or comm-bench (score: mean "
                        "all-reduce bus bandwidth)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=V1,V2",
                   help="an environment axis (repeatable); 'unset' as a value means the variable is absent")
    p.add_argument("--rounds", type=int, default=_D.rounds,
                   help=f"passes over the grid, order rotated (default {_D.rounds})")
    p.add_argument("--method", default=None, help="method whose median tok/s is the score (default: the first)")
    p.add_argument("--save-profile", default=None, metavar="NAME", help="save the best point as launch profile NAME")
    p.add_argument("--timeout", type=float, default=_D.timeout_s, help="seconds allowed per point")
    add_store_args(p, "the run")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environments, run nothing")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments for the command after --, e.g. -- --methods baseline --num-prompts 2")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.profiles import save_profile
    from specdecode.bench.store import ResultsStore
    from specdecode.bench.tune import child_command, plan, point_label, tune
    from specdecode.cli.common import save_and_report, warn_if_building

    console = Console(stderr=True)
    warn_if_building(console)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    config = TuneConfig(env=tuple(args.env), command=args.command, rounds=args.rounds, method=args.method,
                        timeout_s=args.timeout, command_args=tuple(bench_args))
    points = plan(config)
    if args.dry_run:
        for p in points:
            console.print(f"{point_label(p)}: {shlex.join(child_command(args.command, bench_args, Path('OUT.json')))}",
                          markup=False, highlight=False)
        return 0

    result = tune(config,
                  on_point=lambda rnd, point: console.print(
                      f"round {rnd + 1}/{args.rounds}: {point_label(point)} ...", markup=False),
                  on_score=lambda method, value: console.print(f"  {method}: {value:.3g}", markup=False))
    medians, best, method = result.medians, result.best, result.method
    table = Table(title=f"tune ({args.command}): {method}, {len(points)} points x {args.rounds} rounds, "
                        f"{result.elapsed_s:.0f} s")
    for col in ("environment", "per round", "median", "vs best"):
        table.add_column(col, justify="left" if col == "environment" else "right")
    for i in sorted(medians, key=lambda i: medians[i], reverse=True):
        table.add_row(point_label(points[i]), ", ".join(f"{v:.3g}" for v in result.scores[i]), f"{medians[i]:.3g}",
                      f"{medians[i] / medians[best]:.2f}x")
    Console(width=170).print(table)
    console.print(f"best: {point_label(points[best])} ({method} {medians[best]:.3g})", markup=False)
    if not args.no_store:
        save_and_report(result.to_run(), ResultsStore(args.store), None, console)
    if args.save_profile:
        console.print(f"saved launch profile {args.save_profile!r} to "
                      f"{save_profile(result.profile(args.save_profile))}")
    return 0
