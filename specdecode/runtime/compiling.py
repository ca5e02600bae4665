"""Whether the target's and the drafter's steps run compiled (``core.compiled``), and which graphs a
generation or a server's pool needs built (``precompile``, ``precompile_pool``).

On CPU a graph is exported (``torch.export``) and compiled ahead of time by AOTInductor with
freezing, then kept as a package per bucket in ``$SPECDECODE_CACHE/graphs/<weights identity>/``
(``runtime.graphstore.PackageStore``): any later process on this machine loads it in under a second. On
CUDA the steps go through ``torch.compile`` (CUDA graphs), captured in each process.

More in docs/compiled.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.compiled import (
    CompiledRunner,
    GraphKey,
    check_compile_mode,
    span_buckets,
)
from specdecode.core.engine import TokenDecoder
from specdecode.core.model import Transformer
from specdecode.core.speculative import SpecConfig
from specdecode.io.loading import LoadedModel
from specdecode.runtime.graphstore import PackageStore, inductor_cache_dir


def resolve_compile(mode: str, long_running: bool, world_size: int) -> tuple[bool, str]:
    """(compile?, why) for ``--compile MODE``."""
    check_compile_mode(mode)
    if world_size > 1:
        if mode == "on":
            raise ValueError("--compile on with tensor parallelism is not supported (the all-reduce inside every "
                             "layer); use --compile off or --tp 1")
        return False, f"eager: tensor parallelism ({world_size} ranks)"
    if mode != "auto":
        return mode == "on", f"{mode}: as asked"
    if long_running:
        return True, "auto: a long-running job (graphs compile on first use, cached on disk)"
    return False, "auto: a single generation runs only graphs already stored (runtime.compiling.stored_steps)"


def graph_store(device: torch.device, log: Callable[[str], None] | None = None) -> PackageStore | None:
    """Where compiled graphs persist: AOTInductor packages on CPU; none on CUDA (CUDA graphs are
    captured in each process)."""
    return PackageStore(log=log) if device.type == "cpu" else None


def compiled_runner(device: torch.device, on_compile: Callable[[GraphKey, float | None], None] | None = None,
                    store: PackageStore | None = None, build: bool = True) -> CompiledRunner:
    """A runner of compiled steps on ``device``; graphs come from ``store`` or compile at first use
    (``build=False``: only the stored ones, other buckets eager)."""
    inductor_cache_dir()
    return CompiledRunner(device.type, on_compile=on_compile, store=store, build=build)


def stored_steps(model: Transformer, device: torch.device, on_compile: Callable[[GraphKey, float | None], None] | None,
                 log: Callable[[str], None] | None) -> tuple[CompiledRunner | None, str]:
    """``--compile auto`` for a single generation: the graphs this machine has stored for these
    weights (``specdecode compile``) run compiled, other buckets eager; none stored: eager."""
    store = graph_store(device, log)
    n = store.count(model) if store is not None else 0
    if store is None or n == 0:
        return None, ("auto: a single generation stays eager (a graph compiled now costs more than it saves; "
                      "`specdecode compile` stores them for this machine)")
    return (compiled_runner(device, on_compile, store, build=False),
            f"auto: {n} graphs stored for these weights on this machine ({store.root}); other shapes eager")


@dataclass
class Precompiled:
    """What ``precompile`` did: graphs built (key, seconds), graphs already stored, the cache
    sizes covered, and the store's directories and their size on disk."""

    built: list[tuple[GraphKey, float]]
    loaded: int
    sizes: list[int]
    dirs: list[Path]
    disk_bytes: int


def precompile(model: Transformer, steps: CompiledRunner, drafter: Any, specs: Sequence[SpecConfig], max_len: int,
               on_size: Callable[[int, int], None] | None = None) -> Precompiled:
    """Build (or find stored) every graph one request of up to ``max_len`` tokens needs: plain
    decoding, and for each shape in ``specs`` EAGLE-3 with ``drafter`` too (verify, re-extend and tree
    steps; the draft cache in both sizes a target cache size may come with): ``--spec-config auto`` weighs a
    shape against plain decoding, which must run on its graph then too. Shapes share their graphs (a bucket of
    rows x tokens serves every shape that calls it). ``on_size(i, n)`` hears progress by cache size. ``steps``
    must build (``build=True``) into a store."""
    built0, loaded0 = _check_builds(steps)
    margin = max((s.margin for s in specs), default=0)
    context = model.config.max_position_embeddings
    sizes = span_buckets(max_len + margin, context)
    for i, size in enumerate(sizes):
        if on_size is not None:
            on_size(i, len(sizes))
        steps.warm(model, None, 1, size - 1, None)
        for spec in specs:
            new = size - 1 - spec.margin  # the target's cache exactly this size, the draft's one bucket up
            for n in (new, new - spec.draft_scratch):  # ... and the draft's this size
                if n >= 1:
                    steps.warm(model, drafter, 1, n, spec)
    if on_size is not None:
        on_size(len(sizes), len(sizes))
    return _precompiled(steps, (model, drafter), built0, loaded0, sizes)


def precompile_pool(steps: CompiledRunner | None, loaded: LoadedModel, decode: TokenDecoder, batch: BatchConfig,
                    max_len: int, on_size: Callable[[int, int], None] | None = None) -> Precompiled:
    """Build (or find stored) the graphs ``serve`` runs with ``decode`` and ``batch``
    (``BatchEngine.warm``) with ``steps`` (a session's): every batch size bucket up to the slots,
    attention spans up to ``max_len``. ``on_size(i, n)`` hears progress by span."""
    if steps is None:
        raise ValueError("precompile needs compiled steps that build into a store (CPU, --compile on)")
    built0, loaded0 = _check_builds(steps)
    model = loaded.model
    engine = BatchEngine(model, loaded.tokenizer, decode.drafter, decode.spec, batch, runner=steps)
    engine.warm(max_len, on_size)
    sizes = span_buckets(max_len, engine.tpool.max_len)
    return _precompiled(steps, (model, decode.drafter), built0, loaded0, sizes)


def _check_builds(steps: CompiledRunner) -> tuple[int, int]:
    if steps.store is None or not steps.build:
        raise ValueError("precompile needs compiled steps that build into a store (CPU, --compile on)")
    return len(steps.compiled), len(steps.loaded)


def _precompiled(steps: CompiledRunner, modules: tuple[Any, ...], built0: int, loaded0: int,
                 sizes: list[int]) -> Precompiled:
    store = cast(PackageStore, steps.store)
    dirs = sorted({store.root / store.identity(m) for m in modules if m is not None})
    disk = sum(f.stat().st_size for d in dirs if d.is_dir() for f in d.glob("*.pt2"))
    return Precompiled(steps.compiled[built0:], len(steps.loaded) - loaded0, sizes, dirs, disk)
