"""Kernel plans measured once per machine: ``core.kernels.choose_kernels`` at load, its choice
cached on disk (``$SPECDECODE_CACHE/kernels/``, default ``~/.cache/specdecode``) under a key of
the hardware, the torch build, the thread count and the model's layer shapes, so a later load on
the same machine installs it without measuring; another machine, build or thread count measures
anew. The plan is recorded in every result's fingerprint."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specdecode.core.kernels import KERNEL_MODES, ROW_BUCKETS, KernelPlan, apply_kernels, choose_kernels, kernel_layers
from specdecode.io.paths import cache_root


def check_kernel_mode(mode: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; use one of {', '.join(KERNEL_MODES)}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> dict[str, object]:
    """What measured or generated CPU code depends on: CPU, vector ISA torch dispatches to, torch and
    oneDNN builds, threads (kernel plans here, stored graphs in ``runtime.compiling``)."""
    return {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "threads": threads,
    }


def hardware_key(model: nn.Module, threads: int) -> dict[str, object]:
    """What a measured plan depends on: the machine, and the layer groups measured."""
    return machine_key(threads) | {"row_buckets": list(ROW_BUCKETS), "groups": sorted(kernel_layers(model))}


def plan_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{digest}.json"


def install_kernels(model: nn.Module, mode: str, threads: int, device: torch.device,
                    log: Callable[[str], None] | None = None) -> KernelPlan:
    """``auto``: install the cached plan for this machine, or measure one and cache it (CPU only:
    on CUDA every layer keeps F.linear). ``static``: the layers' fixed rules."""
    check_kernel_mode(mode)
    if mode == "static" or device.type != "cpu":
        apply_kernels(model, {})
        return KernelPlan(mode=mode)
    key = hardware_key(model, threads)
    path = plan_path(key)
    if path.exists():
        try:
            choices = json.loads(path.read_text())["choices"]
            apply_kernels(model, choices)
            return KernelPlan(mode, "cached", choices)
        except (ValueError, KeyError, TypeError) as e:  # unreadable or stale: measure again
            if log:
                log(f"kernel plan {path} not usable ({e}); measuring again")
    t = time.perf_counter()

    def progress(done: int, total: int, group: str) -> None:
        if log is None:
            return
        if done == 0:
            log(f"measuring the kernel plan for this machine: {total} layer groups, once (cached in {path}) ...")
            return
        left = (time.perf_counter() - t) / done * (total - done)
        log(f"kernel plan: {done}/{total} groups measured, about {left:.0f} s left (next: {group})")

    # saved as it goes: a measurement cut short (Ctrl-C, a killed job) resumes at the next group
    partial = path.with_suffix(".partial.json")
    known: dict[str, list[str]] = {}
    if partial.exists():
        try:
            saved = json.loads(partial.read_text())
            known = saved["choices"] if saved.get("key") == key else {}
        except (ValueError, KeyError, TypeError):
            known = {}
        if known and log:
            log(f"kernel plan: resuming a measurement cut short ({len(known)} groups already measured)")
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(at: Path, choices: dict[str, list[str]], **extra: object) -> None:
        tmp = at.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "choices": choices, **extra}, indent=1))
        tmp.replace(at)

    def keep(group: str, picked: list[str]) -> None:
        known[group] = picked
        save(partial, known)

    choices = choose_kernels(model, on_group=progress, known=dict(known), on_choice=keep)
    seconds = time.perf_counter() - t
    apply_kernels(model, choices)
    save(path, choices, seconds=round(seconds, 2))
    partial.unlink(missing_ok=True)
    if log:
        log(f"kernels measured in {seconds:.1f} s, cached in {path}")
    return KernelPlan(mode, "measured", choices, seconds)
