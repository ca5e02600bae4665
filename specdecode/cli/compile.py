"""`specdecode compile`: build and store, for this machine, the compiled graphs a generation needs
(``runtime.compiling.precompile``), so later starts load them instead of compiling."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_model_args, add_renamed, add_spec_args, decoder_spec, notice, runtime_config
from specdecode.cli.serve import add_batch_args, batch_config
from specdecode.serving.config import DEFAULT_COMPILE_MAX_LEN

if TYPE_CHECKING:
    from rich.console import Console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile", help=SUBCOMMANDS["compile"][1],
        description="Export and compile ahead of time (AOTInductor) the decode, verify and draft steps a "
                    "request of up to --compile-max-len tokens needs with these flags, one graph per rows x "
                    "tokens bucket (each serves every attention span and cache size), into "
                    "$SPECDECODE_CACHE/graphs. `generate --compile auto` then runs them (loaded in under a "
                    "second each) and the shapes not stored eager. With --serve, the graphs of `serve` with the "
                    "same flags instead (its batch of up to --max-running-requests rows: every batch size "
                    "bucket); `serve --compile auto` loads them before serving. Graphs already stored are not "
                    "built again. About 35 s per target graph and 8 s per draft graph on a 2-core CPU; a 4-bit "
                    "or int8 target's graph reads the loaded weights (3.5 MB on disk), a float one holds a "
                    "frozen copy (docs/compiled.md). CPU only.")
    p.add_argument("--compile-max-len", type=int, default=DEFAULT_COMPILE_MAX_LEN, dest="max_len",
                   help="the longest request (prompt + new tokens) to compile for: caches of 256, 512, ... tokens up "
                        f"to it (default: {DEFAULT_COMPILE_MAX_LEN}; the same flag as serve's)")
    add_renamed(p, "--max-len", "--compile-max-len")
    p.add_argument("--serve", action="store_true",
                   help="the graphs `specdecode serve` with these flags runs (continuous batching), not generate's")
    p.add_argument("--prune", action="store_true",
                   help="instead of compiling: remove the stored graphs of older step code (each directory's "
                        "identity.json says which code built it; no process of this code can load them), then the "
                        "least recently used directories while the store is over its cap ($SPECDECODE_GRAPH_CACHE_GB, "
                        "default 20; also applied after each build), then exit")
    p.add_argument("--dry-run", action="store_true", help="with --prune: list what would go, remove nothing")
    p.add_argument("--with-candidates", action="store_true",
                   help="also every candidate shape --spec-config auto weighs (chains of 1-6, top-2 trees of 1-6, "
                        "top-4 of 1-3 steps: their graphs are shared, 12 in all), so that it times each on graphs "
                        "and can choose any; the default where the shape is left to auto (what `generate`'s "
                        "background build passes after an auto run)")
    p.add_argument("--if-idle", action="store_true",
                   help="exit at once when another process is building into the store (what a build that "
                        "`generate` starts in the background runs); without it, wait for that build to end")
    add_batch_args(p.add_argument_group("serve (with --serve)"))
    add_model_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdecode.runtime.background import build_lock
    from specdecode.runtime.graphstore import PackageStore

    if args.prune:
        return prune(args.dry_run, Console(stderr=True))
    if args.max_len < 2:
        raise ValueError(f"--compile-max-len must be at least 2 tokens, got {args.max_len}")
    batch = batch_config(args) if args.serve else None
    err = Console(stderr=True)
    spec = decoder_spec(args)
    if getattr(args, "compile", "auto") == "off":
        raise ValueError("`specdecode compile` compiles: drop --compile off")
    root = PackageStore().root
    with build_lock(root, wait=False) as mine:
        if mine:
            return _build(args, spec, batch, err)
    if args.if_idle:
        err.print(f"another process is building into {root}: nothing to do", markup=False, highlight=False)
        return 0
    err.print(f"another process is building into {root} (its output: {root / 'build.log'}); waiting for it",
              markup=False, highlight=False)
    with build_lock(root):  # then what it built is found stored, not built again
        return _build(args, spec, batch, err)


def _build(args: argparse.Namespace, spec: Any, batch: Any, err: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdecode.core.compiled import GraphKey
    from specdecode.core.costmodel import AutoSpec, candidate_shapes
    from specdecode.runtime.autospec import cycle_costs
    from specdecode.runtime.compiling import precompile, precompile_pool
    from specdecode.runtime.decoders import build_decoder
    from specdecode.runtime.session import start

    session = start(replace(runtime_config(args), compile="on"), log=notice)
    steps = session.compiled
    if steps is None or steps.store is None:
        raise ValueError(f"graphs are stored on CPU only (device {session.device}: CUDA graphs are captured in "
                         "each process; serve and data build compile them at first use)")
    candidates = batch is None and spec.speculative and (args.with_candidates or (
        isinstance(spec.config, AutoSpec) and not spec.config.complete))
    # with the candidates, the drafter even where auto now predicts plain decoding faster (on eager costs)
    decoder = build_decoder(replace(spec, allow_plain=False) if candidates else spec, session, log=notice)
    err.print(f"format: {session.config.dtype}, {session.config.weights} weights; {decoder.description}",
              markup=False, highlight=False)
    what = "attention spans" if batch is not None else "cache sizes"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(what),
               TimeElapsedColumn(), TextColumn("{task.fields[graph]}"))
    drafter = getattr(decoder.decode, "drafter", None)
    t0 = time.perf_counter()
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("compiling", total=None, graph="")

        def on_size(i: int, n: int) -> None:
            progress.update(task, total=n, completed=i)

        def on_compile(key: GraphKey, seconds: float | None) -> None:
            if seconds is None:
                progress.update(task, graph=f"building {key}")
            else:
                progress.console.print(f"built {key} in {seconds:.1f} s", markup=False, highlight=False)

        steps.on_compile = on_compile
        if batch is not None:
            done = precompile_pool(session.compiled, session.loaded, decoder.decode, batch, args.max_len, on_size)
        else:
            shapes = [decoder.config] if decoder.config is not None else []
            if candidates and drafter is not None:  # a model without a drafter: plain decoding's graph only
                shapes += [s for s in candidate_shapes() if s not in shapes]
            done = precompile(session.loaded.model, steps, drafter, shapes, args.max_len, on_size)
    if done.built and drafter is not None and decoder.drafter_path is not None:
        # --spec-config auto's costs are keyed on the stored graphs: timed now on the new set, a later run
        # finds them cached instead of timing them before its first token
        _, how, _ = cycle_costs(session, drafter, decoder.drafter_path, log=notice)
        err.print(f"speculative cycle costs with these graphs: {how}", markup=False, highlight=False)
    err.print(f"[bold]{len(done.built)} graphs built[/], {done.loaded} already stored, for {what} of "
              f"{', '.join(map(str, done.sizes))} tokens, in {time.perf_counter() - t0:.0f} s; "
              f"{done.disk_bytes / 1e9:.2f} GB in {', '.join(map(str, done.dirs))}")
    command = "serve" if batch is not None else "generate"
    err.print(f"`specdecode {command}` with the same model and flags now runs them (--compile auto)", markup=False)
    return 0


def prune(dry_run: bool, err: Console) -> int:
    from pathlib import Path

    from specdecode.runtime.graphstore import PackageStore

    store = PackageStore()
    report = store.prune(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for where, size in report.removed:
        err.print(f"{verb} {where} ({size / 1e9:.2f} GB): built by other step code", markup=False, highlight=False)

    def total(found: list[tuple[Path, int]]) -> str:
        return f"{len(found)} ({sum(size for _, size in found) / 1e9:.2f} GB)"

    for where, size in report.over_cap:
        err.print(f"{verb} {where} ({size / 1e9:.2f} GB): least recently used, over the cap of "
                  f"{store.max_bytes / 1e9:.1f} GB", markup=False, highlight=False)
    err.print(f"{verb} {total(report.removed + report.over_cap)} graph directories in {store.root}; kept "
              f"{total(report.kept)} of this code", markup=False, highlight=False)
    if report.unrecorded:
        err.print(f"{total(report.unrecorded)} without a record (stored before records were kept; a directory gets "
                  f"one when this code loads it) left: delete them by hand if no model still uses them: "
                  + ", ".join(str(w) for w, _ in report.unrecorded), markup=False, highlight=False)
    return 0
