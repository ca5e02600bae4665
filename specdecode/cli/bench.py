"""`specdecode bench`."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.harness import add_bench_args, cmd_bench

    p = sub.add_parser('bench', help='benchmark decoding methods, interleaved, with a table and JSON',
                       description='Compare decoding methods on the same prompts, model, dtype and threads, run by run interleaved so drift hits all alike.')
    add_bench_args(p)
    add_model_args(p)
    p.set_defaults(func=cmd_bench)
