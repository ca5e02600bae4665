"""PNG plots of measured runs (matplotlib, headless): the sweep's four figures and a run's
speed per method for ``report``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from specdecode.bench.store import Run

PLOTS_EXTRA_HINT = "PNG plots need matplotlib: pip install 'specdecode[plots]'"


def plots_available() -> bool:
    """matplotlib is an optional extra (``specdecode[plots]``): measuring never depends on it."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot() -> Any:
    """matplotlib.pyplot, headless; a ValueError naming the extra when it is not installed."""
    if not plots_available():
        raise ValueError(PLOTS_EXTRA_HINT)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sweep_plots(result: dict, out_dir: Path) -> list[Path]:
    """Throughput vs steps, phase breakdown, verify cost vs tokens, acceptance by position
    (none without matplotlib: the measurements are in sweep.json either way)."""
    if not plots_available():
        return []
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = result["configs"]
    paths = []

    def save(fig, name: str) -> None:
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({c["topk"] for c in configs}):
        pts = sorted((c["num_steps"], c["tok_per_s"]) for c in configs if c["topk"] == k)
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"topk={k}")
    ax.axhline(1000 / result["baseline_ms_per_token"], color="gray", ls="--", label="baseline")
    ax.set(xlabel="num_steps (draft depth)", ylabel="tok/s (median)", title="Throughput vs draft steps")
    ax.legend()
    save(fig, "tok_s_vs_steps.png")

    fig, ax = plt.subplots(figsize=(max(6, len(configs) * 0.8), 4))
    bottom = [0.0] * len(configs)
    for phase in ("draft", "verify", "extend", "other"):
        vals = [c["phases_ms"][phase] for c in configs]
        ax.bar(range(len(configs)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(configs)), [c["method"].removeprefix("eagle3:") for c in configs], rotation=45,
                  ha="right", fontsize=7)
    ax.set(ylabel="ms per cycle", title="Where each cycle's time goes")
    ax.legend()
    save(fig, "phase_breakdown.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    vm = result["verify_ms_by_tokens"]
    ax.plot([int(n) for n in vm], list(vm.values()), marker="o")
    ax.axhline(result["baseline_ms_per_token"], color="gray", ls="--", label="baseline decode step")
    ax.set(xlabel="tokens verified", ylabel="target verify ms", title="Verify cost vs tokens verified")
    ax.legend()
    save(fig, "verify_ms_vs_tokens.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        ax.plot(range(1, len(c["per_position_accept"]) + 1), c["per_position_accept"], marker=".",
                label=c["method"].removeprefix("eagle3:"))
    ax.set(xlabel="draft position (depth)", ylabel="share of cycles accepted", ylim=(0, 1),
           title="Acceptance by position")
    ax.legend(fontsize=6)
    save(fig, "acceptance_by_position.png")
    return paths


def speed_plot(run: Run, out_dir: Path) -> Path | None:
    """Median tok/s per method with min-max bars; None when the run has no speeds."""
    rows = [s for s in run.summary if "tok_per_s_median" in s]
    if not rows:
        return None
    if not plots_available():
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 3.6))
    med = [s["tok_per_s_median"] for s in rows]
    lo = [m - s.get("tok_per_s_min", m) for m, s in zip(med, rows, strict=True)]
    hi = [s.get("tok_per_s_max", m) - m for m, s in zip(med, rows, strict=True)]
    ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color="tab:blue")
    ax.set_xticks(range(len(rows)), [s["method"] for s in rows], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="tok/s (median, min-max)", title=f"{run.kind} {run.run_id}")
    fig.tight_layout()
    path = out_dir / f"{run.run_id}-speed.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
