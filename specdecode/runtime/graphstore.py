"""Compiled CPU graphs kept on disk: what identifies a graph (the step code, the weights, the package
format), how a step is exported and packaged by AOTInductor, how a package is checked and loaded
(``LoadedGraph``), and the store that keeps them per weights identity, least recently used first out
(``PackageStore``). ``runtime.compiling`` decides when steps run compiled and builds these. More in
docs/compiled.md.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import weakref
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import specdecode.core as core_package
from specdecode.core.attention import NATIVE_ATTENTION, NATIVE_ATTENTION_AVX512
from specdecode.core.compiled import INDUCTOR_OPTIONS, GraphKey
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.kernels import native_loaded
from specdecode.core.model import Transformer
from specdecode.core.quant import detect_format
from specdecode.io.paths import cache_root
from specdecode.runtime.kernels import machine_key


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache under ours ($SPECDECODE_CACHE/inductor) unless the user set one."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


# A stored graph is valid for one build of these: a change here makes every package a new file.
PACKAGE_VERSION = 3  # 2: graphs bind the live weights (binds_weights); 3: any span (span_dynamic_shapes)
_SAMPLES = 4096  # elements read from each tensor for a module's identity


# The modules of ``specdecode.core`` whose code a graph is traced from: the steps (``compiled``'s
# TargetStep and DraftStep, its padding) call ``Transformer.step`` and ``Eagle3Drafter.step``, which run
# attention, the cache writes and the linear layers' kernels (``quant``, ``kernels``); the modules
# these import within core are here too (tests/runtime/test_compiling.py checks). A change elsewhere
# in core (continuous batching, the speculative cycle, sampling) leaves the stored graphs valid: a
# server's set of graphs takes minutes to build on 2 cores.
TRACED_MODULES = ("attention", "compiled", "drafter", "kernels", "kvcache", "model", "quant")


@functools.cache
def code_identity() -> str:
    """The step code a graph was traced from (``TRACED_MODULES``' code), so a changed step never loads an
    old package. Their syntax trees without comments and docstrings: a comment changed there rebuilt every
    stored graph."""
    h = hashlib.sha256()
    root = Path(core_package.__file__).parent
    for name in TRACED_MODULES:
        h.update(name.encode() + _code_only((root / f"{name}.py").read_text()).encode())
    for src in sorted((root / "csrc").glob("*.cpp")):  # the native kernels graphs call (runtime.native)
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:16]


def _code_only(source: str) -> str:
    """``source``'s syntax tree without docstrings (comments are not in it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return ast.dump(tree)


BOUND = "specdecode.bound"  # a package's metadata: "1" where it carries no weights (binds_weights)
HELD = "specdecode.held"  # a package's metadata: the held tensors it takes as trailing inputs, comma-separated
HELD_PREFIX = "held_"  # exportable's names of the modules a step holds in lists


def package_options(bound: bool = False, held: list[str] | None = None) -> dict[str, Any]:
    """The inductor options of a stored (AOTInductor) CPU graph: the compiled steps' own, less the C++
    wrapper (an AOTInductor package is C++ through and through). ``bound``: without freezing and
    without the weights, which the loader binds from the live module (``binds_weights``); ``held``:
    the names of the tensors it takes as trailing inputs (``HeldAsInputs``)."""
    options = {k: v for k, v in INDUCTOR_OPTIONS["cpu"].items() if k != "cpp_wrapper"}
    metadata = {HELD: ",".join(held)} if held else {}
    if bound:
        options.update({"freezing": False, "aot_inductor.package_constants_in_so": False})
        metadata[BOUND] = "1"
    if metadata:
        options["aot_inductor.metadata"] = metadata
    return options


def binds_weights(module: nn.Module) -> bool:
    """Whether a stored graph of ``module`` reads the live module's weights, bound at load, instead of
    carrying a frozen copy: where its linear layers are integer kernels (int8, 4-bit), our own ops
    either way. There a graph is 3.6 MB instead of 155 and adds 1 MB of memory instead of 303,
    bit-identical to eager, 2-6% slower per step (with the dynamic span; one run); a drafter in integer
    kernels (``--drafter-weights``) likewise. Freezing packs float
    linear weights for oneDNN, which pays where float matmuls are the step: a draft step ran 2.3x as
    fast frozen, a bf16 target's decode step 1.8x (benchmarks/results/2026-12-06-bound-graphs,
    docs/LOG.md). Those freeze, less the tensors they hold but do not own (``HeldAsInputs``)."""
    return isinstance(module, Transformer | Eagle3Drafter) and detect_format(module) != "native"


class HeldAsInputs(nn.Module):
    """``step`` taking the tensors of the modules it holds but does not own (``exportable``'s ``held_*``:
    a drafter's view of the target's embedding) as trailing inputs, so a frozen graph never copies them:
    they are the target's, 56 MB of a draft graph's 78 for SmolLM2."""

    def __init__(self, step: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.step, self.names = step, names

    def forward(self, *args: Any) -> Any:
        n = len(self.names)
        return torch.func.functional_call(self.step, dict(zip(self.names, args[-n:], strict=True)), args[:-n])


@contextlib.contextmanager
def exportable(step: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """``step`` with every tensor it reads under a name, for a while: plain tensor attributes (the rope
    frequencies, kept out of buffers so ``.to(dtype)`` leaves them float32) become non-persistent
    buffers, and modules held in lists (a drafter's view of the target's embedding) submodules of
    ``step``. Yields the tensors by the names ``torch.export``, and so a package's constants, give
    them. Attribute reads see the same tensor throughout (another thread may be decoding)."""
    held = [h for m in list(step.modules()) for v in vars(m).values() if isinstance(v, list | tuple)
            for h in v if isinstance(h, nn.Module)]
    names = [f"{HELD_PREFIX}{i}" for i in range(len(held))]
    for name, h in zip(names, held, strict=True):
        step.add_module(name, h)
    plain = [(m, attr, v) for m in step.modules() for attr, v in list(vars(m).items())
             if isinstance(v, torch.Tensor) and v.layout == torch.strided]  # not oneDNN's opaque packed weights
    for m, attr, v in plain:
        m._buffers[attr] = v
        m._non_persistent_buffers_set.add(attr)
        del m.__dict__[attr]
    try:
        tensors: dict[str, torch.Tensor] = dict(step.named_parameters(remove_duplicate=False))
        tensors.update(step.named_buffers(remove_duplicate=False))
        yield tensors
    finally:
        for m, attr, v in plain:
            m.__dict__[attr] = v
            m._buffers.pop(attr, None)
            m._non_persistent_buffers_set.discard(attr)
        for name in names:
            delattr(step, name)


def live_tensors(step: nn.Module) -> dict[str, torch.Tensor]:
    """What a bound graph of ``step`` reads, by name (``exportable``)."""
    with exportable(step) as tensors:
        return tensors


def _held_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module and those it holds outside its own tree (a drafter keeps the target's embedding in
    a list, which ``state_dict`` does not see but an exported graph bakes in)."""
    held = [(f"{attr}.{i}", m) for attr, v in vars(module).items() if isinstance(v, list | tuple)
            for i, m in enumerate(v) if isinstance(m, nn.Module)]
    return [("", module), *held]


def weights_identity(module: nn.Module) -> str:
    """What a graph compiled from ``module`` embeds and depends on: its configuration, every
    parameter and buffer, its own and those of modules it holds in lists (name, shape, dtype and an
    even sample of its values: cheap, and a different file, format or quantization changes it), the
    kernel each layer's plan chose, whether attention runs the native kernel, the step code
    (``code_identity``), and the machine (CPU, vector ISA, torch build, threads: generated code is
    built for them)."""
    h = hashlib.sha256()
    h.update(repr((PACKAGE_VERSION, code_identity(), type(module).__name__, getattr(module, "config", None),
                   sorted(machine_key(torch.get_num_threads()).items()),
                   # the graph calls one of the attention operators, or SDPA
                   [op for op in (NATIVE_ATTENTION_AVX512, NATIVE_ATTENTION) if native_loaded(op)])).encode())
    for prefix, owner in _held_modules(module):
        for name, t in owner.state_dict(keep_vars=True).items():
            flat = t.detach().reshape(-1)
            n = flat.numel()
            k = min(n, _SAMPLES)
            sample = flat[torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)] if n else flat
            h.update(f"{prefix}/{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        for name, m in owner.named_modules():
            if getattr(m, "kernels", None) is not None:
                h.update(f"{prefix}/{name}:{m.kernels}".encode())
    return h.hexdigest()[:16]


def _whole_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False


LITERALS = "specdecode/literals.json"  # in a package without weights: the constants inductor made itself


@contextlib.contextmanager
def literal_constants() -> Iterator[dict[str, dict[str, Any]]]:
    """The tensors inductor adds to a graph while compiling it (``GraphLowering.add_tensor_constant`` with no
    name: a 4-bit matmul's group size, lowering ``aten._weight_int4pack_mm_for_cpu``), recorded by name. A
    package without weights (``package_constants_in_so=False``) holds none of its constants, these included,
    so the loader binds them from here (on an AVX2 EPYC, whose kernel plan takes int4pack, every 4-bit graph
    was refused for lacking them). Only small tensors are expected; their values are kept as lists."""
    from torch._inductor.graph import GraphLowering  # inductor: imported only when building

    recorded: dict[str, dict[str, Any]] = {}
    original = GraphLowering.add_tensor_constant

    def recording(self: GraphLowering, data: torch.Tensor, name: str | None = None) -> Any:
        box = original(self, data, name)
        if name is None:
            recorded[box.get_name()] = {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                                        "data": data.flatten().tolist()}
        return box

    GraphLowering.add_tensor_constant = recording  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        GraphLowering.add_tensor_constant = original  # type: ignore[method-assign]


def aoti_package(exported: torch.export.ExportedProgram, path: Path, bound: bool, held: list[str]) -> None:
    """``exported`` compiled by AOTInductor into a package at ``path`` (``package_options``); without weights
    (``bound``), the constants inductor made itself go with it (``literal_constants``)."""
    with literal_constants() as literals:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path),
                                                 inductor_configs=package_options(bound, held))
    if bound and literals:
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(LITERALS, json.dumps(literals))


def read_literals(path: Path) -> dict[str, torch.Tensor]:
    """A package's recorded inductor constants (``literal_constants``), as tensors."""
    with zipfile.ZipFile(path) as z:
        if LITERALS not in z.namelist():
            return {}
        literals = json.loads(z.read(LITERALS))
    return {name: torch.tensor(c["data"], dtype=getattr(torch, c["dtype"])).reshape(c["shape"])
            for name, c in literals.items()}


class LoadedGraph:
    """An AOTInductor package run by torch's C++ loader, called like the module it was exported from.
    ``torch._inductor.aoti_load_package`` imports inductor and dynamo (2.3 s per process on a 2-core
    EPYC) and parses the output tree on every call; this does neither. A package without weights
    (``binds_weights``) reads ``tensors`` (``live_tensors``) in place, never a copy."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        # The loader extracts the package (its library and weights: 150 MB for SmolLM2) into a directory
        # under $TMPDIR that it removes only when destroyed, which a process ending (a server stopped with
        # SIGTERM, any exit) does not do: 54 GB of them filled this machine's disk in a day. Extracted into
        # a directory of our own, removed once loaded: the library stays mapped, the weights in memory.
        scratch = tempfile.mkdtemp(prefix="specdecode-aoti-")
        with _tmpdir(scratch):
            try:
                self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        self.out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])
        metadata = self.loader.get_metadata()
        bound = self.loader.get_constant_fqns() if metadata.get(BOUND) == "1" else []
        held = [n for n in metadata.get(HELD, "").split(",") if n]
        live = {**read_literals(path), **(tensors or {})}
        missing = [n for n in (*bound, *held) if n not in live]
        if missing:
            raise ValueError(f"{path.name} reads weights the module does not have ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): built from other code or another module")
        self.bound = {n: live[n].detach() for n in bound}  # kept here: the graph reads their memory
        if bound:
            self.loader.load_constants(self.bound, False, True, True)  # user-managed: no copy
        self.held = [live[n].detach() for n in held]  # trailing inputs of every call

    def __call__(self, *args: torch.Tensor | list[torch.Tensor]) -> Any:
        flat = [t for a in args for t in (a if isinstance(a, list) else (a,))] + self.held  # the export's order
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)


_TMPDIR_LOCK = threading.Lock()


@contextlib.contextmanager
def _tmpdir(path: str) -> Iterator[None]:
    """$TMPDIR set to ``path`` for a while (the C++ loader reads it), one thread at a time."""
    with _TMPDIR_LOCK:
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = path
        try:
            yield
        finally:
            if old is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = old


@dataclass
class PackageStore:
    """Compiled CPU graphs kept on disk (``core.compiled.GraphStore``): each bucket's step exported
    (``torch.export``, the span and cache size dynamic) and compiled ahead of time by AOTInductor into
    a package under ``root/<weights identity>/``, which any later process on this machine loads in
    under a second: bound to the live weights or frozen (``binds_weights``). Through ``torch.compile``
    a graph took 202 s cold and 34 s from inductor's cache on a 2-core EPYC, as dynamo, AOT autograd
    and freezing run again in every process (docs/compiled.md)."""

    root: Path = field(default_factory=lambda: cache_root() / "graphs")
    log: Callable[[str], None] | None = None
    max_bytes: int = field(default_factory=lambda: graph_cache_cap())  # least recently used directories go beyond it
    _ids: weakref.WeakKeyDictionary[nn.Module, str] = field(default_factory=weakref.WeakKeyDictionary)

    def identity(self, module: nn.Module) -> str:
        if module not in self._ids:
            self._ids[module] = weights_identity(module)
        return self._ids[module]

    def path(self, module: nn.Module, key: GraphKey) -> Path:
        kind = re.sub(r"[^a-z0-9]+", "-", key.kind.lower()).strip("-")
        cache = "x".join(str(d) if d else "n" for d in key.cache)  # n: any (a dynamic dimension)
        span = f"-s{key.span}" if key.span else ""
        return self.root / self.identity(module) / f"{kind}-r{key.rows}-t{key.tokens}{span}-c{cache}.pt2"

    def count(self, module: nn.Module) -> int:
        """How many graphs of ``module``'s weights are stored."""
        return len(self.names(module))

    def names(self, module: nn.Module) -> list[str]:
        """The graphs stored for ``module``'s weights, by file name, sorted."""
        where = self.root / self.identity(module)
        return sorted(p.name for p in where.glob("*.pt2")) if where.is_dir() else []

    def load(self, module: nn.Module, key: GraphKey, step: nn.Module) -> Callable[..., Any] | None:
        path = self.path(module, key)
        if not path.is_file():
            return None
        # Every member's CRC checked first (milliseconds): the C++ loader runs a corrupt library it extracted and
        # the process dies by SIGTRAP, with no message (a package whose bytes changed on disk).
        if not _whole_zip(path):
            if self.log is not None:
                self.log(f"compiled graph {path} is damaged (cut short, or its content fails its CRC check): removed; "
                         "this shape is compiled again or runs eager")
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        try:
            graph = LoadedGraph(path, live_tensors(step))
            _record(path.parent)  # a directory stored before records: this code uses it, so it is current
            _used(path.parent)
            return graph
        except (RuntimeError, OSError, ValueError) as e:
            if self.log is not None:
                self.log(f"compiled graph {path} could not be loaded ({type(e).__name__}: {str(e)[:200]}); it is "
                         "kept; this shape runs eager or is compiled again")
            return None

    def build(self, module: nn.Module, key: GraphKey, step: nn.Module, args: tuple[Any, ...],
              dynamic_shapes: tuple[Any, ...] | None = None) -> Callable[..., Any]:
        inductor_cache_dir()
        path = self.path(module, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Exported outside inference mode on copies: the caller's tensors may be inference tensors,
        # which tracing cannot write to.
        bound = binds_weights(module)
        with torch.inference_mode(False), torch.no_grad(), exportable(step) as tensors:
            example = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
            held = [] if bound else [n for n in tensors if n.startswith(HELD_PREFIX)]
            if held:
                step, example = HeldAsInputs(step, held), (*example, *(tensors[n] for n in held))
                if dynamic_shapes is not None:  # forward(*args): one argument, the tuple
                    dynamic_shapes = ((*dynamic_shapes, *(None,) * len(held)),)
            exported = torch.export.export(step, example, dynamic_shapes=dynamic_shapes)
            # built beside, outside the glob count() reads: a build killed midway leaves no package
            tmp = path.parent / BUILDING / f"{path.stem}.{os.getpid()}.pt2"
            tmp.parent.mkdir(exist_ok=True)
            _prune_partials(path.parent)
            try:
                aoti_package(exported, tmp, bound, held)
                os.replace(tmp, path)  # whole or not at all
            finally:
                tmp.unlink(missing_ok=True)
        _record(path.parent)
        _used(path.parent)
        for where, size in self.trim(keep=path.parent):
            if self.log is not None:
                self.log(f"graph store over its cap ({self.max_bytes / 1e9:.1f} GB, ${CAP_ENV}): removed the least "
                         f"recently used {where} ({size / 1e9:.2f} GB)")
        return LoadedGraph(path, tensors)

    def trim(self, keep: Path | None = None, dry_run: bool = False,
             gone: frozenset[Path] = frozenset()) -> list[tuple[Path, int]]:
        """Remove whole weight directories, least recently used first (their record's time, set at each load
        and build), until the store holds at most ``max_bytes``; never ``keep`` (the one in use). ``gone``:
        directories a dry run counts as removed already."""
        if not self.root.is_dir():
            return []
        dirs = [(_last_use(w), w, _size(w)) for w in self.root.iterdir() if w.is_dir() and w not in gone]
        total = sum(size for _, _, size in dirs)
        removed = []
        for _, where, size in sorted(dirs, key=lambda d: d[0]):
            if total <= self.max_bytes:
                break
            if keep is not None and where.resolve() == keep.resolve():
                continue
            removed.append((where, size))
            total -= size
            if not dry_run:
                shutil.rmtree(where, ignore_errors=True)
        return removed

    def prune(self, dry_run: bool = False) -> PruneReport:
        """Remove the graph directories of other step code or package versions (their record says so):
        no process of this code can load them. Directories without a record (stored before records,
        never loaded since) are left, and counted: they may belong to another model or thread count."""
        report = PruneReport()
        if not self.root.is_dir():
            return report
        for where in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if not dry_run:
                _prune_partials(where)
            size = _size(where)
            try:
                record = json.loads((where / RECORD).read_text())
            except FileNotFoundError:
                report.unrecorded.append((where, size))
                continue
            except (ValueError, OSError):
                record = {}
            if record.get("code") == code_identity() and record.get("package_version") == PACKAGE_VERSION:
                report.kept.append((where, size))
                continue
            report.removed.append((where, size))
            if not dry_run:
                shutil.rmtree(where, ignore_errors=True)
        for where, size in self.trim(dry_run=dry_run, gone=frozenset(w for w, _ in report.removed)):
            report.kept = [k for k in report.kept if k[0] != where]
            report.unrecorded = [k for k in report.unrecorded if k[0] != where]
            report.over_cap.append((where, size))
        return report


RECORD = "identity.json"  # in each graph directory: the step code and package version its graphs were built by
BUILDING = ".building"  # in each graph directory: packages being built, named <graph>.<pid of the builder>.pt2


def _prune_partials(where: Path) -> None:
    """Remove what builds killed midway left in ``where``'s building directory: files of processes no longer
    alive (a file without a pid in its name once it is a day old)."""
    for partial in (where / BUILDING).glob("*") if (where / BUILDING).is_dir() else ():
        parts = partial.name.split(".")
        pid = int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
        with contextlib.suppress(OSError):
            if (not _alive(pid)) if pid is not None else time.time() - partial.stat().st_mtime > 86400:
                if partial.is_dir():
                    shutil.rmtree(partial, ignore_errors=True)
                else:
                    partial.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
CAP_ENV = "SPECDECODE_GRAPH_CACHE_GB"
DEFAULT_GRAPH_CACHE_GB = 20.0  # serve's full set with every span is about 7 GB today (docs/compiled.md)


def graph_cache_cap() -> int:
    """The graph store's cap in bytes: $SPECDECODE_GRAPH_CACHE_GB, else DEFAULT_GRAPH_CACHE_GB."""
    raw = os.environ.get(CAP_ENV, "")
    try:
        gb = float(raw) if raw else DEFAULT_GRAPH_CACHE_GB
    except ValueError:
        raise ValueError(f"${CAP_ENV}={raw!r} is not a number of GB: set it like {CAP_ENV}=20 (inf: no cap)") from None
    if not gb > 0:  # nan too
        raise ValueError(f"${CAP_ENV}={raw!r} must be a positive number of GB (inf: no cap): unset it for "
                         f"{DEFAULT_GRAPH_CACHE_GB:g} GB")
    return sys.maxsize if math.isinf(gb) else int(gb * 1e9)


def _size(where: Path) -> int:
    return sum(f.stat().st_size for f in where.rglob("*") if f.is_file())


def _used(where: Path) -> None:
    """Mark ``where`` as used now (its record's time), for ``PackageStore.trim``."""
    with contextlib.suppress(OSError):
        os.utime(where / RECORD)


def _last_use(where: Path) -> float:
    for path in (where / RECORD, where):
        with contextlib.suppress(OSError):
            return path.stat().st_mtime
    return 0.0


@dataclass
class PruneReport:
    removed: list[tuple[Path, int]] = field(default_factory=list)  # (directory, bytes)
    kept: list[tuple[Path, int]] = field(default_factory=list)
    unrecorded: list[tuple[Path, int]] = field(default_factory=list)
    over_cap: list[tuple[Path, int]] = field(default_factory=list)  # least recently used, beyond the cap


def _record(where: Path) -> None:
    """Write ``where``'s record once (what ``PackageStore.prune`` reads)."""
    path = where / RECORD
    if path.exists():
        return
    tmp = where / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps({"code": code_identity(), "package_version": PACKAGE_VERSION,
                               "machine": machine_key(torch.get_num_threads())}, indent=1))
    os.replace(tmp, path)
