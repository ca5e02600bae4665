"""`specdecode comm-bench`: all-reduce time and bandwidth over message sizes, like nccl-tests.

Every verify pass of a tensor-parallel target pays two all-reduces per layer of a few KB
(one hidden state per verified token), so latency at small sizes decides decode speed
while bandwidth matters for prefill. For each size: the slowest rank's time per call
(median over iterations), algorithm bandwidth = bytes / time, and bus bandwidth =
algbw * 2(n-1)/n (what each link carries in a ring all-reduce), as nccl-tests reports.
Environment variables (NCCL_*, GLOO_*, OMP_*) are read at start-up: search them with
``specdecode tune --command comm-bench --env ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    try:
        value = int(float(num) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"size {text!r}: expected e.g. 4K, 64KB, 1M, 16MB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(n: int) -> str:
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


def bus_factor(world: int) -> float:
    return 2 * (world - 1) / world


def _measure(rank: int, world: int, port: int, sizes: list[int], iters: int, warmup: int, backend: str,
             dtype_name: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dtype = getattr(torch, dtype_name)
    rows = []
    for size in sizes:
        t = torch.ones(max(1, size // torch.tensor([], dtype=dtype).element_size()), dtype=dtype, device=device)
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            if backend == "nccl":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest.to(device), op=dist.ReduceOp.MAX) if backend == "nccl" else dist.all_reduce(
            slowest, op=dist.ReduceOp.MAX)
        med = statistics.median(slowest.tolist())
        nbytes = t.numel() * t.element_size()
        algbw = nbytes / med / 1e9
        rows.append({"size_bytes": nbytes, "count": t.numel(), "time_us_median": 1e6 * med,
                     "time_us_p90": 1e6 * sorted(slowest.tolist())[int(0.9 * (len(times) - 1))],
                     "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(world)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_comm_bench(world: int, sizes: list[int], iters: int = 20, warmup: int = 5, backend: str = "auto",
                   dtype: str = "float32") -> tuple[str, list[dict]]:
    """(backend, one row per size) measured by ``world`` fresh processes on this machine."""
    import torch
    import torch.multiprocessing as mp

    from specdecode.runtime.tp import free_port

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"--backend nccl needs {world} GPUs; torch sees {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_measure, args=(world, free_port(), sizes, iters, warmup, backend, dtype, str(out)),
                           nprocs=world, join=True, start_method="spawn")
        return backend, json.loads(out.read_text())


def add_comm_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2, help="processes (ranks) on this machine (default 2)")
    p.add_argument("--sizes", type=size_list, default=size_list("2K,8K,32K,128K,512K,2M,8M"),
                   help="message sizes, e.g. 2K,64K,1M (default: a decode step's few KB up to 8MB)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--out", default=None, help="write the run to FILE (.jsonl appends; else one JSON document)")
    p.add_argument("--store", default=None, help="SQLite results store (default: $SPECDECODE_RESULTS_DB)")
    p.add_argument("--no-store", action="store_true")


def cmd_comm_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.fingerprint import capture
    from specdecode.bench.store import ResultsStore, Run, new_run_id, save_run

    if args.world < 2:
        raise ValueError(f"--world must be >= 2 (an all-reduce needs two ranks), got {args.world}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    backend, rows = run_comm_bench(args.world, args.sizes, args.iters, args.warmup, args.backend, args.dtype)
    table = Table(title=f"all-reduce, {backend}, {args.world} ranks, {args.dtype} (slowest rank, median of "
                        f"{args.iters})")
    for col in ("size", "count", "time us", "p90 us", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(human(r["size_bytes"]), str(r["count"]), f"{r['time_us_median']:.1f}",
                      f"{r['time_us_p90']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
    (Console(width=150) if not sys.stdout.isatty() else Console()).print(table)
    summary = [{"method": f"allreduce {human(r['size_bytes'])}"} | r for r in rows]
    score = statistics.fmean(r["busbw_gbps"] for r in rows)
    fingerprint = capture(threads=1, dtype=args.dtype, device=f"{backend} x{args.world}") | {"backend": backend}
    run = Run(new_run_id(), "comm-bench", time.strftime("%Y-%m-%d %H:%M:%S"), fingerprint, summary, [],
              {"world": args.world, "backend": backend,
               "score": {"name": "busbw GB/s, mean over sizes", "value": score}})
    save_run(run, None if args.no_store else ResultsStore(args.store), args.out, Console(stderr=True))
    return 0
