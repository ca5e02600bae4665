"""`specdecode runs`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.store import add_runs_args, cmd_runs

    p = sub.add_parser('runs', help='list the runs in the results store',
                       description='list the runs in the results store')
    add_runs_args(p)
    p.set_defaults(func=cmd_runs)
