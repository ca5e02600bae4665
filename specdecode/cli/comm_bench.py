"""`specdecode comm-bench`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.comm import add_comm_bench_args, cmd_comm_bench

    p = sub.add_parser('comm-bench', help='all-reduce time, algbw and busbw over message sizes (like nccl-tests)',
                       description='all-reduce time, algbw and busbw over message sizes (like nccl-tests)')
    add_comm_bench_args(p)
    p.set_defaults(func=cmd_comm_bench)
