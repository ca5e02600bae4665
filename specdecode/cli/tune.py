"""`specdecode tune`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.tune import add_tune_args, cmd_tune

    p = sub.add_parser('tune', help='search a grid of environment variables, each point in a fresh process',
                       description='Run `specdecode bench` or `comm-bench` (arguments after --) once per point of the environment grid, each in a fresh process (these variables are read at start-up), rounds rotated against drift; report the best point and save it as a launch profile.')
    add_tune_args(p)
    p.set_defaults(func=cmd_tune)
