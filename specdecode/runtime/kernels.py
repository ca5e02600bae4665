"""Kernel plans measured once per machine: ``core.kernels.choose_kernels`` at load, its choice
cached on disk (``$SPECDECODE_CACHE/kernels/``, default ``~/.cache/specdecode``) under a key of
the hardware, the torch build, the thread count and the model's layer shapes, so a later load on
the same machine installs it without measuring; another machine, build or thread count measures
anew. The plan is recorded in every result's fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specdecode.core.kernels import (
    KERNEL_MODES,
    MEASURE_METHOD,
    ONEDNN_F32,
    ROW_BUCKETS,
    KernelPlan,
    apply_kernels,
    choose_kernels,
    kernel_layers,
    offered,
)
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


# fp32 copies of bf16 or 4-bit weights (``onednn_f32``) are offered while they take at most this share of the
# memory available at load: on SmolLM2-135M at 4 bits 0.42 GB; on a 7B model they would be 28 GB
F32_COPY_MEMORY_SHARE = 0.25


def available_memory() -> int | None:
    """Bytes of memory available now (Linux, macOS), None where the system does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def f32_copy_bytes(model: nn.Module) -> int:
    """Bytes of the fp32 copies every layer offering ``onednn_f32`` would hold if its plan chose it."""
    total = 0
    for layers in kernel_layers(model).values():
        if any(ONEDNN_F32 in layers[0].kernel_candidates(rows) for rows in ROW_BUCKETS):
            w = layers[0].packable_weight()
            total += 4 * w.numel() * len(layers)
    return total


def excluded_kernels(model: nn.Module, available: int | None = None) -> frozenset[str]:
    """Kernels the plan may not choose here: ``onednn_f32`` when its copies would take more than
    F32_COPY_MEMORY_SHARE of the available memory (or that is unknown)."""
    need = f32_copy_bytes(model)
    available = available_memory() if available is None else available
    if need and (available is None or need > F32_COPY_MEMORY_SHARE * available):
        return frozenset({ONEDNN_F32})
    return frozenset()


def hardware_key(model: nn.Module, threads: int, exclude: frozenset[str] = frozenset()) -> dict[str, object]:
    """What a measured plan depends on: the machine, the layer groups measured and the kernels each
    could choose (a new kernel, or one excluded for memory, makes a new plan)."""
    candidates = {key: sorted({k for rows in ROW_BUCKETS for k in offered(layers[0], rows, exclude)})
                  for key, layers in kernel_layers(model).items()}
    return machine_key(threads) | {"row_buckets": list(ROW_BUCKETS), "groups": sorted(kernel_layers(model)),
                                   "candidates": candidates, "measured": MEASURE_METHOD}


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
    exclude = excluded_kernels(model)
    if exclude and log:
        log(f"kernel plan: no fp32 weight copies (onednn_f32): {f32_copy_bytes(model) / 1e9:.2f} GB would exceed "
            f"{F32_COPY_MEMORY_SHARE:.0%} of the memory available")
    key = hardware_key(model, threads, exclude)
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

    choices = choose_kernels(model, on_group=progress, known=dict(known), on_choice=keep, exclude=exclude)
    seconds = time.perf_counter() - t
    apply_kernels(model, choices)
    save(path, choices, seconds=round(seconds, 2))
    partial.unlink(missing_ok=True)
    if log:
        log(f"kernels measured in {seconds:.1f} s, cached in {path}")
    return KernelPlan(mode, "measured", choices, seconds)
