"""Process groups for tensor parallelism: this process's rank, joining a group from the
environment, and spawning local workers. Sharding a built model is
``specdecode.runtime.sharding``.

Launch: ``specdecode generate|bench|sweep|check --tp N`` spawns N local workers (gloo on
CPU, NCCL on CUDA); under ``torchrun`` the process group comes from its environment.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from specdecode.runtime.device import available_cores

WORKER_ENV = "SPECDECODE_TP_WORKER"  # set in spawned workers: do not spawn again


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    return world()[0] == 0


def init_from_env(device: str = "cpu") -> bool:
    """Join the process group described by torchrun-style variables, if any."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return dist.is_initialized()
    backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    if dist.get_rank() != 0:  # one voice: rank 0 prints and stores results
        devnull = open(os.devnull, "w")  # noqa: SIM115 (stays open: it replaces stdout/stderr for good)
        sys.stdout, sys.stderr = devnull, devnull
    return True


def close_group(wait: bool = True) -> None:
    """Leave the process group; ``wait``: after every rank is done. A rank that tore gloo down while
    another still used its connections aborted the other ("terminate called without an active
    exception": test_sharding's two-rank test, about 2 runs in 5 on a 2-core Xeon)."""
    if wait:
        dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(rank: int, size: int, port: int, entry: Callable[[list[str]], int], argv: list[str],
            threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), WORKER_ENV: "1",
                       "SPECDECODE_THREADS": os.environ.get("SPECDECODE_THREADS") or str(threads)})
    code = entry(argv)
    if dist.is_initialized():
        close_group(wait=not code)
    if code:
        raise SystemExit(code)


def spawn(entry: Callable[[list[str]], int], argv: list[str], size: int) -> int:
    """Run ``entry(argv)`` (a picklable, module-level function: the CLI's ``main``) as ``size``
    tensor-parallel workers on this machine; each joins the process group from its environment."""
    from torch.multiprocessing.spawn import (
        ProcessContext,
        ProcessExitedException,
        ProcessRaisedException,
        start_processes,
    )


    threads = max(1, available_cores() // size)  # oversubscribing cores slowed decode 5x here
    start: Callable[..., ProcessContext] = start_processes  # torch leaves it unannotated
    ctx = start(_worker, args=(size, free_port(), entry, argv, threads), nprocs=size, join=False,
                start_method="spawn")
    # SIGTERM goes to rank 0, which ends its work (a server finishes its request) and releases
    # the other ranks; Ctrl-C reaches every worker through the process group anyway.
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(ctx.processes[0].pid, signal.SIGTERM))
    try:
        while not ctx.join():
            pass
    except ProcessRaisedException as e:
        print(f"specdecode: a tensor-parallel worker failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    except ProcessExitedException as e:
        return e.exit_code or 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
