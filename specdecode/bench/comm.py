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

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from specdecode.bench.fingerprint import capture
from specdecode.bench.store import Run, new_run_id, now

SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    try:
        value = int(float(num) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"size {text!r}: expected e.g. 4K, 64KB, 1M, 16MB") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
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
    if world < 2:
        raise ValueError(f"--world must be >= 2 (an all-reduce needs two ranks), got {world}")
    if iters < 1 or warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    import torch  # torch, only when measuring: reading and printing results runs without it
    import torch.multiprocessing as mp

    from specdecode.runtime.distributed import free_port

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"--backend nccl needs {world} GPUs; torch sees {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_measure, args=(world, free_port(), sizes, iters, warmup, backend, dtype, str(out)),
                           nprocs=world, join=True, start_method="spawn")
        return backend, json.loads(out.read_text())


def score(rows: list[dict]) -> dict:
    """What ``tune --command comm-bench`` maximises: mean bus bandwidth over the sizes."""
    return {"name": "busbw GB/s, mean over sizes", "value": statistics.fmean(r["busbw_gbps"] for r in rows)}


def comm_run(world: int, backend: str, dtype: str, rows: list[dict]) -> Run:
    """The measurement as a stored run (one summary row per size)."""
    summary = [{"method": f"allreduce {human(r['size_bytes'])}"} | r for r in rows]
    fingerprint = capture(threads=1, dtype=dtype, device=f"{backend} x{world}") | {"backend": backend}
    return Run(new_run_id(), "comm-bench", now(), fingerprint, summary, [],
               {"world": world, "backend": backend, "score": score(rows)})
