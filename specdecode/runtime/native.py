"""The project's own CPU kernels (``specdecode/core/csrc``), built with the machine's C++ compiler at
first use and kept in ``$SPECDECODE_CACHE/native/`` (13-15 s on a 2-core EPYC, once per source version; the build
needs g++, which compiled steps need anyway, and ninja).

Five modules, each built and loaded only where the CPU has its instructions: ``avx2`` (AVX2 + FMA),
``avx512`` (the same linear kernels with AVX-512 VNNI), ``rows`` (the row-invariant integer family,
AVX-512 VNNI: ``core.quant``), ``attention`` (few-query attention, AVX2 + FMA) and ``attention512`` (the
same with AVX-512 BF16, preferred where loaded: ``core.attention``),
each its own shared library, so no code compiled for AVX-512 can run on a CPU without it, and
``SPECDECODE_NATIVE`` can leave any one out of an A/B.

More in docs/formats.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.core import quant
from specdecode.io.paths import cache_root
from specdecode.runtime.autoformat import machine_cpu_flags

_CSRC = Path(quant.__file__).parent / "csrc"


@dataclass(frozen=True)
class NativeModule:
    name: str
    source: Path
    needs: frozenset[str]  # the CPU flags (/proc/cpuinfo's names) its code is compiled for
    cflags: tuple[str, ...]
    ops: tuple[str, ...]  # the torch.ops.specdecode operators it registers


MODULES = (
    NativeModule("avx2", _CSRC / "avx2_linear.cpp", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma"),
                 ("q4_linear", "i8_linear")),
    NativeModule("avx512", _CSRC / "avx512_linear.cpp",
                 frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
                 ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
                 ("q4_linear_avx512", "i8_linear_avx512")),
    NativeModule("rows", _CSRC / "rows_linear.cpp",
                 frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
                 ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
                 (quant.ROWS_Q4, quant.ROWS_I8)),
    # its own module, so SPECDECODE_NATIVE=avx2,avx512 measures the linear kernels without it
    NativeModule("attention", _CSRC / "small_attention.cpp", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma"),
                 ("small_attention",)),
    NativeModule("attention512", _CSRC / "attention_avx512.cpp",
                 frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
                 ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                 ("small_attention_avx512",)),
)

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # module name: None once loaded, else why not


def source_identity(module: NativeModule = MODULES[0]) -> str:
    h = hashlib.sha256()
    h.update(module.source.name.encode() + module.source.read_bytes())
    for header in sorted(_CSRC.glob("*.h")):  # what the sources include
        h.update(header.name.encode() + header.read_bytes())
    h.update(" ".join(module.cflags).encode())
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


def why_unavailable(flags: frozenset[str] | None = None, module: NativeModule = MODULES[0]) -> str | None:
    """Why ``module``'s kernels cannot run here before trying to build them, or None."""
    asked = os.environ.get("SPECDECODE_NATIVE", "1").strip()
    if asked == "0":
        return "SPECDECODE_NATIVE=0"
    if asked not in ("1", "") and module.name not in asked.split(","):
        return f"SPECDECODE_NATIVE={asked} (the modules to load, of {', '.join(m.name for m in MODULES)})"
    have = machine_cpu_flags() if flags is None else flags
    missing = sorted(module.needs - have)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def load_native(log: Callable[[str], None] | None = None) -> str | None:
    """Build (once per source version and torch build) and load every native module this CPU can run;
    returns None when the base (AVX2) kernels are registered, else the reason they are not. A reason
    is said through ``log`` once per module (a CPU without AVX-512 is not worth a line)."""
    with _lock:
        for module in MODULES:
            if module.name in _state:
                continue
            reason = why_unavailable(None, module)
            if reason is None:
                reason = _build(module, log)
            _state[module.name] = reason
            if reason is not None and log is not None and not reason.startswith("SPECDECODE_NATIVE=") and (
                    module is MODULES[0] or not reason.startswith("the CPU lacks")):
                log(f"native CPU kernels ({module.name}) not used: {reason}")
        return _state[MODULES[0].name]


def _build(module: NativeModule, log: Callable[[str], None] | None) -> str | None:
    from torch.utils import cpp_extension

    name = f"specdecode_{module.name}_{source_identity(module)}"
    where = cache_root() / "native" / name
    where.mkdir(parents=True, exist_ok=True)
    built = any(where.glob(f"{name}*.so"))
    if not built and log is not None:
        log(f"building the native CPU kernels ({module.name}) once (13-15 s on a 2-core EPYC) into {where} ...")
    _ninja_on_path()
    try:
        with _builder_lock(where):
            source = _staged_source(module, where)
            cpp_extension.load(name, [str(source)], build_directory=str(where), is_python_module=False,
                               extra_cflags=["-O3", *module.cflags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                               verbose=False)
    except (RuntimeError, OSError, ImportError, SystemExit, subprocess.SubprocessError) as e:
        # no compiler or ninja, a failed or interrupted build: aten's kernels run instead
        last = (str(e).strip().splitlines() or [""])[-1][:200]
        return f"the build failed ({type(e).__name__}: {last}); see {where}"
    for op in module.ops:
        _register_fake(op)
    return None


def _staged_source(module: NativeModule, where: Path) -> Path:
    """The module's source and the headers it includes, copied under ``where`` (written only when they differ,
    so their times stay): the build then has one source path whichever checkout builds it. From the
    checkout's own path, a build by another checkout (a CI clone) made the next start build again, silently:
    57 s of a first run's model load on a 2-core EPYC."""
    staged = where / "src"
    staged.mkdir(exist_ok=True)
    for f in (module.source, *sorted(_CSRC.glob("*.h"))):
        data, copy = f.read_bytes(), staged / f.name
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return staged / module.source.name


@contextlib.contextmanager
def _builder_lock(where: Path) -> Iterator[None]:
    """Hold an flock on ``where`` (released by the kernel when its process dies) while torch's extension
    builder runs. The builder's own lock is a file it creates and removes (``lock``), waiting, silently and
    without end, while one exists: a process killed while loading (Ctrl-C during a start) left one
    behind, and every later start hung there. Under the flock no live process of ours is building here, so
    such a file is stale and removed."""
    with open(where / ".specdecode-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (where / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _register_fake(op: str) -> None:
    """Shapes for tracing (``torch.export``, ``torch.compile``): the kernels run only on real tensors. The
    linear operators are (x [rows, in], weight [out, ...], ...) -> [rows, out] in x's dtype; attention
    gives q's shape."""

    def linear(x: torch.Tensor, weight: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    def attention(q: torch.Tensor, *rest: object) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    torch.library.register_fake(f"specdecode::{op}")(attention if op.startswith("small_attention") else linear)
