"""Stored graphs as package version 1 built them (frozen, their own copy of every weight, a graph per span)
against what the store builds now (``runtime.compiling``: bound to the live weights or frozen less the tensors a
step holds, any span), timed in one process (issue 49).

For each step (the target's decode step, its verify of 2 tokens with the drafter's taps, one draft step), it
builds both into a scratch directory: version 1 once per span, now once. Then, at each span, it calls eager, the
version 1 graph of that span and today's graph in turn, ROUNDS x CALLS times, and checks each graph's logits
against eager bit for bit.

    .venv/bin/python benchmarks/archive/graph_packages.py --spans 256,1024 \\
        --out benchmarks/results/2026-12-06-bound-graphs/raw/packages.json

Prints the table and writes JSON with the environment fingerprint."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from specdecode.bench.fingerprint import capture
from specdecode.core.compiled import DraftStep, GraphKey, TargetStep, dummy_inputs, span_dynamic_shapes
from specdecode.io.checkpoints import load_drafter
from specdecode.io.paths import default_drafter_path
from specdecode.runtime.graphstore import LoadedGraph, PackageStore, binds_weights, exportable, package_options
from specdecode.runtime.session import RuntimeConfig, start


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def frozen_v1(step: nn.Module, args: tuple[Any, ...], path: Path) -> tuple[LoadedGraph, dict[str, float]]:
    """A package as version 1 built it: frozen, its own copy of every weight it reads, this span only."""
    with torch.inference_mode(False), torch.no_grad(), exportable(step):
        example = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
        t0 = time.perf_counter()
        torch._inductor.aoti_compile_and_package(torch.export.export(step, example), package_path=str(path),
                                                 inductor_configs=package_options())
        seconds = time.perf_counter() - t0
    return measured_load(lambda: LoadedGraph(path), path, seconds)


def current(store: PackageStore, owner: nn.Module, step: nn.Module, tokens: int,
            args: tuple[Any, ...]) -> tuple[Any, dict[str, float]]:
    """A package as the store builds it now (bound or frozen by ``binds_weights``, any span), loaded anew."""
    key = GraphKey(1, tokens, 0, type(step).__name__, (0,), id(owner))
    t0 = time.perf_counter()
    store.build(owner, key, step, args, span_dynamic_shapes(args))
    seconds = time.perf_counter() - t0
    return measured_load(lambda: store.load(owner, key, step), store.path(owner, key), seconds)


def measured_load(load: Any, path: Path, seconds: float) -> tuple[Any, dict[str, float]]:
    before = rss_mb()
    t0 = time.perf_counter()
    graph = load()
    return graph, {"build_s": round(seconds, 1), "load_s": round(time.perf_counter() - t0, 3),
                   "package_mb": round(path.stat().st_size / 1e6, 2), "rss_added_mb": round(rss_mb() - before, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=ints, default=[256, 1024], help="attention spans (cache slots), comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30, help="timed calls per graph, span and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/graph-packages/packages.json"))
    args = p.parse_args()
    session = start(RuntimeConfig(compile="off", threads=args.threads))
    model = session.loaded.model
    drafter_path = default_drafter_path()
    if drafter_path is None:
        p.error("this checkout has no shipped drafter (specdecode/drafters/): the draft step needs one")
    drafter = load_drafter(drafter_path, model)
    taps = tuple(drafter.config.aux_layer_ids)
    width = len(taps) * model.config.hidden_size
    steps: dict[str, tuple[nn.Module, nn.Module, int, Any]] = {  # name: (owner, step, tokens, inputs for a span)
        "decode": (model, TargetStep(model, ()), 1,
                   lambda s: (*dummy_inputs(1, 1, s, model.device), *kv(model, s))),
        "verify2": (model, TargetStep(model, taps), 2,
                    lambda s: (*dummy_inputs(1, 2, s, model.device), *kv(model, s))),
        "draft": (drafter, DraftStep(drafter), 1,
                  lambda s: (*dummy_inputs(1, 1, s, model.device), *kv(drafter, s),
                             torch.randn(1, 1, width, dtype=model.dtype))),
    }
    scratch = Path(tempfile.mkdtemp(prefix="graph-packages-"))
    store = PackageStore(scratch / "store", max_bytes=1 << 40)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name, (owner, step, tokens, inputs) in steps.items():
            graphs = {}
            now, info = current(store, owner, step, tokens, inputs(args.spans[0]))
            kind = "bound" if binds_weights(owner) else "frozen, held tensors as inputs"
            print(f"{name}: now ({kind}, any span): {info}", flush=True)
            builds = {"now": dict(info, kind=kind)}
            for span in args.spans:
                graphs[span], info = frozen_v1(step, inputs(span), scratch / f"{name}-v1-{span}.pt2")
                builds[f"v1_s{span}"] = info
                print(f"{name}: version 1 (frozen, span {span}): {info}", flush=True)
            for span in args.spans:
                call = inputs(span)
                call[3][...] = True  # every key visible: a full context
                eager = step(*call)
                runs = {"eager": step, "v1": graphs[span], "now": now}
                same = {k: bool(torch.equal(fn(*call)[0], eager[0])) for k, fn in runs.items() if k != "eager"}
                times: dict[str, list[float]] = {k: [] for k in runs}
                for _ in range(args.rounds):
                    for k, fn in runs.items():
                        fn(*call)
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            fn(*call)
                        times[k].append((time.perf_counter() - t0) / args.calls * 1e3)
                ms = {k: round(statistics.median(v), 3) for k, v in times.items()}
                rows.append({"step": name, "span": span, "ms": ms, "ms_rounds": times,
                             "now_vs_v1": round(ms["now"] / ms["v1"], 3), "bit_equal_to_eager": same})
                print(f"{name:8s} span {span:5d}: eager {ms['eager']:.2f} ms, version 1 {ms['v1']:.2f}, now "
                      f"{ms['now']:.2f} (now/v1 {ms['now'] / ms['v1']:.3f}); equal to eager: {same}", flush=True)
            rows.append({"step": name, "builds": builds})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    environment = capture(threads=session.threads, dtype=session.dtype_name, device=str(session.device),
                          weights=session.config.weights, kernels=session.kernels.summary(),
                          compiled="stored graphs: version 1 against now")
    args.out.write_text(json.dumps({"environment": environment, "rounds": args.rounds, "calls": args.calls,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


def kv(module: Any, span: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cache = module.new_cache(1, span) if isinstance(module, nn.Module) and hasattr(module, "layers") \
        else module.new_cache(span)
    return cache.k, cache.v


if __name__ == "__main__":
    raise SystemExit(main())
