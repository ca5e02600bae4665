"""`specdecode train-report`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.report import add_report_args, cmd_report

    p = sub.add_parser('train-report', help='acceptance vs training-set size: table and PNG plot',
                       description='acceptance vs training-set size: table and PNG plot')
    add_report_args(p)
    p.set_defaults(func=cmd_report)
