"""`specdecode sweep`: measure a grid of speculative configurations against the baseline, per
(dtype, threads) setting; tables, plots, the results store."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdecode.bench.plots import PLOTS_EXTRA_HINT, plots_available
from specdecode.bench.sweep import SweepConfig
from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import (
    add_model_args,
    add_prompt_args,
    add_renamed,
    add_store_args,
    compile_notice,
    non_negative_int,
    notice,
    positive_int,
)

_D = SweepConfig()


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers, each at least 1 (depths, widths, thread counts)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers of at least 1, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help=SUBCOMMANDS["sweep"][1],
                       description="Measure every configuration on the same prompts, interleaved with the baseline; "
                                   "report the optimum, verify cost vs tokens verified, acceptance per position, a "
                                   "cost-model prediction, and PNG plots.")
    p.add_argument("--num-steps", type=int_list, default=list(_D.steps), dest="steps",
                   help="draft depths to measure, e.g. 1,2,3,4")
    add_renamed(p, "--steps", "--num-steps")
    p.add_argument("--topk", type=int_list, default=list(_D.topk), help="branchings to measure, e.g. 1,2,4")
    p.add_argument("--num-draft-tokens", type=int_list, default=None, dest="draft_tokens",
                   help="tree nodes verified, for topk > 1 (default: each shape's own rule)")
    add_renamed(p, "--draft-tokens", "--num-draft-tokens")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    add_prompt_args(p, _D.max_new_tokens)
    p.add_argument("--runs", type=positive_int, default=_D.runs, help="passes over the prompt set")
    p.add_argument("--warmup", type=non_negative_int, default=_D.warmup,
                   help="untimed runs per configuration before measuring")
    p.add_argument("--dtypes", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                   help="sweep these dtypes too, e.g. float32,bfloat16 (default: --dtype)")
    p.add_argument("--threads-grid", type=int_list, default=None,
                   help="sweep these thread counts too, e.g. 1,2 (default: --threads)")
    p.add_argument("--out", default="sweep", help="directory for sweep.json and the PNG plots")
    add_store_args(p, "the run")
    add_model_args(p)
    p.set_defaults(func=run)


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(prompts=args.prompts, num_prompts=args.num_prompts, per_category=args.per_category,
                       max_new_tokens=args.max_new_tokens, runs=args.runs, warmup=args.warmup, drafter=args.drafter,
                       launch_profile=args.launch_profile, steps=tuple(args.steps), topk=tuple(args.topk),
                       draft_tokens=tuple(args.draft_tokens) if args.draft_tokens else None)


def run(args: argparse.Namespace) -> int:
    """One sweep per (dtype, threads) setting; each is its own interleaved measurement with its own
    baseline (settings cannot be interleaved: a model is loaded per dtype). With several settings
    the outputs go to OUT/DTYPE-Nt/ and a last table compares the settings' best points."""
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.sweep import settings
    from specdecode.cli.common import runtime_config, warn_if_building

    console = Console(stderr=True)
    warn_if_building(console)
    config = sweep_config(args)
    points = settings(runtime_config(args), args.dtypes, args.threads_grid)
    bests = []
    for sub, runtime in points:
        result = sweep_one(args, config, runtime, Path(args.out) / sub if sub else Path(args.out), console)
        if result["best"]:
            best = next(c for c in result["configs"] if c["method"] == result["best"])
            bests.append((f"{result['dtype']}, {result['threads']} threads", 1000 / result["baseline_ms_per_token"],
                          best))
    if len(points) > 1 and bests:
        table = Table(title="best configuration per setting (each with its own interleaved baseline)")
        for col in ("setting", "baseline tok/s", "best config", "tok/s", "speedup", "accept len"):
            table.add_column(col, justify="left" if col in ("setting", "best config") else "right")
        for label, base, c in sorted(bests, key=lambda b: -b[2]["tok_per_s"]):
            table.add_row(label, f"{base:.1f}", c["method"].removeprefix("eagle3:"), f"{c['tok_per_s']:.1f}",
                          f"{c['speedup']:.2f}x", f"{c['accept_length']:.2f}")
        Console(width=170).print(table)
        top = max(bests, key=lambda b: b[2]["tok_per_s"])
        console.print(f"fastest overall: {top[2]['method']} at {top[0]} ({top[2]['tok_per_s']:.1f} tok/s)")
    return 0


def sweep_one(args: argparse.Namespace, config: SweepConfig, runtime: Any, out: Path, console: Any) -> dict:
    """One setting: measure, then (rank 0) write sweep.json and plots, store, print the table."""
    import sys

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specdecode.bench.harness import profile_contradictions
    from specdecode.bench.store import ResultsStore
    from specdecode.bench.sweep import SweepPlan, write_sweep
    from specdecode.cli.common import save_and_report
    from specdecode.runtime.session import start
    from specdecode.runtime.weights import weight_format

    session = start(runtime, on_compile=compile_notice, log=notice)
    plan = SweepPlan(config, session)
    for w in profile_contradictions(plan.fingerprint):
        print(w, file=sys.stderr)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=plan.progress_total)
        sweep = plan.run(on_progress=lambda: progress.advance(task))
    result = sweep.result
    if not session.is_main:  # tensor parallel: rank 0 writes for all
        return result
    path = write_sweep(sweep, out)
    if not args.no_store:
        save_and_report(sweep.to_run(), ResultsStore(args.store), None, console)

    weights = session.config.weights
    fmt = session.config.dtype + (f", {weights} weights" if weight_format(weights).quantized else "")
    table = Table(title=f"sweep: {sweep.prompts} prompts, {fmt}, {session.threads} threads; baseline "
                        f"{1000 / result['baseline_ms_per_token']:.1f} tok/s")
    for col in ("config", "verified", "accept len", "tok/s", "speedup", "predicted", "draft", "verify", "extend",
                "other", "same output"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for c in result["configs"]:
        ph = c["phases_ms"]
        table.add_row(c["method"].removeprefix("eagle3:"), str(c["tokens_verified"]), f"{c['accept_length']:.2f}",
                      f"{c['tok_per_s']:.1f}", f"{c['speedup']:.2f}x",
                      f"{c['predicted_speedup']:.2f}x" if "predicted_speedup" in c else "-",
                      f"{ph['draft']:.1f}", f"{ph['verify']:.1f}", f"{ph['extend']:.1f}", f"{ph['other']:.1f}",
                      c["outputs_match_baseline"])
    Console(width=170).print(table)
    best = sweep.best
    if best and "predicted_speedup" in best:
        gap = best["predicted_speedup"] / best["speedup"] - 1
        console.print(f"at the optimum the cost model predicted {best['predicted_speedup']:.2f}x against "
                      f"{best['speedup']:.2f}x measured ({100 * gap:+.1f}%)")
    console.print(f"best: {result['best']}; verify ms by tokens verified: "
                  + ", ".join(f"{n}: {v:.1f}" for n, v in result["verify_ms_by_tokens"].items()))
    console.print(f"wrote {path} and {len(result['plots'])} plots"
                  + ("" if plots_available() else f" ({PLOTS_EXTRA_HINT})"))
    return result
