"""`specdecode compare`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.compare import add_compare_args, cmd_compare

    p = sub.add_parser('compare', help='compare two stored runs: speed ratio with significance, environment diff ranked',
                       description='Per method, the B/A speed ratio with a 95% CI and a p-value (paired by prompt when possible), and the fingerprint differences ranked by likely impact; a change beyond noise in a changed environment is reported first.')
    add_compare_args(p)
    p.set_defaults(func=cmd_compare)
