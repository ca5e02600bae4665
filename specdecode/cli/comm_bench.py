"""`specdecode comm-bench`: all-reduce time and bandwidth over message sizes, like nccl-tests
(a front end to ``specdecode.bench.comm``)."""

from __future__ import annotations

import argparse
import sys

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args

DEFAULT_SIZES = "2K,8K,32K,128K,512K,2M,8M"  # a decode step's few KB up to 8MB


def size_list(text: str) -> list[int]:
    from specdecode.bench.comm import size_list as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("comm-bench", help=SUBCOMMANDS["comm-bench"][1],
                       description="all-reduce time, algbw and busbw over message sizes (like nccl-tests)")
    p.add_argument("--world", type=int, default=2, help="processes (ranks) on this machine (default 2)")
    p.add_argument("--sizes", type=size_list, default=size_list(DEFAULT_SIZES),
                   help="message sizes, e.g. 2K,64K,1M (default: a decode step's few KB up to 8MB)")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per message size")
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per message size first")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="element type of the messages")
    p.add_argument("--out", default=None, help="write the run to FILE (.jsonl appends; else one JSON document)")
    add_store_args(p, "the run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.comm import comm_run, human, run_comm_bench
    from specdecode.bench.store import ResultsStore
    from specdecode.cli.common import save_and_report

    backend, rows = run_comm_bench(args.world, args.sizes, args.iters, args.warmup, args.backend, args.dtype)
    table = Table(title=f"all-reduce, {backend}, {args.world} ranks, {args.dtype} (slowest rank, median of "
                        f"{args.iters})")
    for col in ("size", "count", "time us", "p90 us", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(human(r["size_bytes"]), str(r["count"]), f"{r['time_us_median']:.1f}",
                      f"{r['time_us_p90']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
    (Console(width=150) if not sys.stdout.isatty() else Console()).print(table)
    run = comm_run(args.world, backend, args.dtype, rows)
    save_and_report(run, None if args.no_store else ResultsStore(args.store), args.out, Console(stderr=True))
    return 0
