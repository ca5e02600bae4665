"""`specdecode train-report`: acceptance against training-set size, as a table and a PNG plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.cli.commands import SUBCOMMANDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-report", help=SUBCOMMANDS["train-report"][1],
                       description="acceptance vs training-set size: table and PNG plot")
    p.add_argument("runs", nargs="+", help="output directories of `specdecode train`")
    p.add_argument("--plot", default=None, help="also plot accept length against samples into this PNG")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.training.report import collect, markdown, plot

    rows = collect(args.runs)
    print(markdown(rows))
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
