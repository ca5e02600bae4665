"""`specdecode runs`: list the runs in the results store."""

from __future__ import annotations

import argparse

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help=SUBCOMMANDS["runs"][1], description="list the runs in the results store")
    add_store_args(p, writes=False)
    p.add_argument("--limit", type=positive_int, default=20, help="list the N latest runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.store import ResultsStore

    store = ResultsStore(args.store)
    table = Table(title=f"runs in {store.path} (newest first)")
    for col in ("run id", "kind", "created", "methods: tok/s median"):
        table.add_column(col)
    for r in store.list_runs(args.limit):
        table.add_row(r["run_id"], r["kind"], r["created"], ", ".join(
            f"{s['method']}: {s['tok_per_s_median']:.1f}" for s in r["summary"] if "tok_per_s_median" in s))
    Console(width=170).print(table)
    return 0

