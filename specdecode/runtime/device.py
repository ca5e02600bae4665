"""Process-level settings that change speed: threads, device. Set explicitly, recorded."""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (flag > SPECDECODE_THREADS > OMP_NUM_THREADS > cores
    available): an OMP_NUM_THREADS in the environment (or a launch profile) is honoured,
    as every OpenMP program would, and the fingerprint records it.

    Oversubscription (more threads than cores) slowed decode 5x on a 2-core machine,
    so the default is the number of cores this process may run on.
    """
    if threads is None:
        env = os.environ.get("SPECDECODE_THREADS") or os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
        try:
            threads = int(env) if env else available_cores()
        except ValueError:
            raise ValueError(f"SPECDECODE_THREADS/OMP_NUM_THREADS must be an integer, got {env!r}") from None
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device here")
    return device


def synchronize(device: torch.device | str) -> None:
    """Make wall-clock timers honest on asynchronous devices."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
