"""`specdecode report`: one Markdown or HTML page from stored runs (a front end to
``specdecode.bench.report.write_report``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help=SUBCOMMANDS["report"][1],
                       description="one Markdown or HTML page from stored runs: tables, plots, what changed")
    p.add_argument("runs", nargs="+", help="run ids (or prefixes, 'latest') in the store, or results files")
    p.add_argument("--out", default="report.md", help="report.md (Markdown + PNGs beside it) or report.html "
                                                      "(one self-contained file)")
    add_store_args(p, writes=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.bench.report import write_report
    from specdecode.bench.store import ResultsStore, load_run

    store = ResultsStore(args.store)
    runs = [load_run(ref, store) for ref in args.runs]
    out = Path(args.out)
    plots = write_report(runs, out)
    print(f"wrote {out} ({len(runs)} runs, {plots} plots)")
    return 0
