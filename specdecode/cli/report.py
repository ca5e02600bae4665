"""`specdecode report`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.report import add_run_report_args, cmd_run_report

    p = sub.add_parser('report', help='one Markdown or HTML page from stored runs: tables, plots, what changed',
                       description='one Markdown or HTML page from stored runs: tables, plots, what changed')
    add_run_report_args(p)
    p.set_defaults(func=cmd_run_report)
