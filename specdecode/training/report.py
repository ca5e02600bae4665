"""Acceptance against training-set size, as a table and a plot (`specdecode train-report`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specdecode.bench.plots import pyplot
from specdecode.training.dataset import DataSet, token_counts


def collect(run_dirs: list[str]) -> list[dict]:
    rows = []
    for d in run_dirs:
        path = Path(d) / "training_summary.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found (is {d} a finished `specdecode train` output?)")
        s = json.loads(path.read_text())
        ev = s.get("final_eval") or {}
        rows.append({
            "run": str(d), "samples": s["samples"], "assistant_tokens": s.get("assistant_tokens"),
            "steps": s["steps"], "coverage": s["coverage"], "minutes": s["seconds_this_run"] / 60,
            "accept_length_by_depth": {int(k): v for k, v in (ev.get("accept_length_by_depth") or {}).items()},
            "step_acc": ev.get("step_acc", []), "config": s.get("config", {}),
            "heldout_coverage": heldout_coverage(Path(d), s.get("config", {}).get("data")),
        })
    return sorted(rows, key=lambda r: r["samples"])


def heldout_coverage(run: Path, data: str | None) -> float | None:
    """Share of the data set's held-out assistant tokens inside the run's draft vocabulary:
    every other greedy token is a certain rejection. None without the drafter or the data."""
    from safetensors import safe_open

    weights = run / "model.safetensors"
    if data is None or not weights.exists() or not (Path(data) / "index.jsonl").exists():
        return None
    with safe_open(str(weights), "pt") as f:
        ids = f.get_tensor("d2t").long().numpy() + np.arange(f.get_slice("d2t").get_shape()[0])
    ds = DataSet(data)
    counts = token_counts(ds, int(ds.tokens().max()) + 1, split="heldout")
    total = int(counts.sum())
    return float(counts[ids[ids < len(counts)]].sum()) / total if total else None


def differing_settings(rows: list[dict]) -> list[str]:
    """The training settings that differ between the runs (the variables a comparison varies)."""
    keys = sorted({k for r in rows for k in r["config"]} - {"out", "eval_every", "save_every", "eval_data"})
    return [k for k in keys if len({json.dumps(r["config"].get(k)) for r in rows}) > 1]


def markdown(rows: list[dict], depths: tuple[int, ...] = (1, 2, 3, 4, 5)) -> str:
    """One row per run; when the runs differ in more than their data, a "settings" column names
    what differs (draft vocab, TTT depth, learning rate...)."""
    varied = [k for k in differing_settings(rows) if k != "limit_samples"]
    head = ("| settings " if varied else "") + "| samples | assistant tokens | steps " \
        + "| draft-vocab coverage (train) | (held-out) | " \
        + " | ".join(f"accept len (chain {d})" for d in depths) + " | step-1 acc | minutes |"
    lines = [head, "|" + "---|" * (7 + len(depths) + bool(varied))]
    for r in rows:
        acc = r["accept_length_by_depth"]
        step1 = f"{r['step_acc'][0]:.2f}" if r["step_acc"] else "-"
        settings = ", ".join(f"{k}={r['config'].get(k)}" for k in varied)
        lines.append((f"| {settings} " if varied else "")
                     + f"| {r['samples']} | {r['assistant_tokens'] or '-'} | {r['steps']} "
                     + f"| {100 * r['coverage']:.1f}% | "
                     + (f"{100 * r['heldout_coverage']:.1f}% | " if r["heldout_coverage"] is not None else "- | ")
                     + " | ".join(f"{acc[d]:.2f}" if d in acc else "-" for d in depths)
                     + f" | {step1} | {r['minutes']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, depths: tuple[int, ...] = (2, 3, 4, 5)) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in depths:
        pts = [(r["samples"], r["accept_length_by_depth"][d]) for r in rows if d in r["accept_length_by_depth"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"chain of {d}")
    ax.set_xscale("log")
    ax.set(xlabel="training samples (target-generated responses)", ylabel="held-out accept length",
           title="EAGLE-3 drafter for SmolLM2-135M: data scaling")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
