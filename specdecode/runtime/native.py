"""The project's own CPU kernels (``specdecode/core/csrc``), built with the machine's C++ compiler at
first use and kept in ``$SPECDECODE_CACHE/native/`` (13-15 s on a 2-core EPYC, once per source version; the build
needs g++, which compiled steps need anyway, and ninja).

``load_native()`` registers the ``torch.ops.specdecode`` operators; ``core.quant`` offers their kernels
to the kernel plan only once they are registered, so a machine that cannot build them (no compiler,
no AVX2 + FMA) runs as before, and the reason is said once. ``SPECDECODE_NATIVE=0`` turns them off
(an A/B against aten's kernels: the kernel plan's key changes with the kernels offered)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from specdecode.core import quant
from specdecode.io.paths import cache_root
from specdecode.runtime.autoformat import machine_cpu_flags

SOURCES = (Path(quant.__file__).parent / "csrc" / "avx2_linear.cpp",)
NEEDS_FLAGS = frozenset({"avx2", "fma"})  # the instructions the sources are compiled for

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "reason": None once loaded, else why not


def source_identity() -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.name.encode() + src.read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from $PATH; the ``ninja`` package's own binary is
    not there when the venv is not activated (``.venv/bin/specdecode``)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def why_unavailable(flags: frozenset[str] | None = None) -> str | None:
    """Why the native kernels cannot run here before trying to build them, or None."""
    if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
        return "SPECDECODE_NATIVE=0"
    have = machine_cpu_flags() if flags is None else flags
    missing = sorted(NEEDS_FLAGS - have)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def load_native(log: Callable[[str], None] | None = None) -> str | None:
    """Build (once per source version and torch build) and load the native kernels; returns None when
    they are registered, else the reason they are not (said through ``log`` the first time)."""
    with _lock:
        if "reason" in _state:
            return _state["reason"]
        reason = why_unavailable()
        if reason is None:
            reason = _build(log)
        _state["reason"] = reason
        if reason is not None and log is not None and reason != "SPECDECODE_NATIVE=0":
            log(f"native CPU kernels not used: {reason}")
        return reason


def _build(log: Callable[[str], None] | None) -> str | None:
    from torch.utils import cpp_extension

    name = f"specdecode_native_{source_identity()}"
    where = cache_root() / "native" / name
    where.mkdir(parents=True, exist_ok=True)
    built = any(where.glob(f"{name}*.so"))
    if not built and log is not None:
        log(f"building the native CPU kernels once (13-15 s on a 2-core EPYC) into {where} ...")
    _ninja_on_path()
    try:
        cpp_extension.load(name, [str(s) for s in SOURCES], build_directory=str(where), is_python_module=False,
                           extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           verbose=False)
    except (RuntimeError, OSError, ImportError, SystemExit, subprocess.SubprocessError) as e:
        # no compiler or ninja, a failed or interrupted build: aten's kernels run instead
        last = (str(e).strip().splitlines() or [""])[-1][:200]
        return f"the build failed ({type(e).__name__}: {last}); see {where}"
    _register_fakes()
    return None


def _register_fakes() -> None:
    """Shapes for tracing (``torch.export``, ``torch.compile``): the kernels run only on real tensors."""

    @torch.library.register_fake("specdecode::q4_linear")
    def _q4_linear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], qs.shape[0])

    @torch.library.register_fake("specdecode::i8_linear")
    def _i8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[0])
