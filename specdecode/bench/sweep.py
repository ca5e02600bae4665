"""`specdecode sweep`: find the best speculative configuration by measuring, not guessing.

Every grid point runs on the same prompts, interleaved with the baseline. Beside the
measured speedup sits a prediction from a cost model built from measurements of the
same run: per-position acceptance (from the deepest chain) gives the expected accept
length of each depth, and the measured per-cycle costs (draft ms per step, verify ms
as a function of tokens verified, re-extend and overhead) give the cycle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode.bench.harness import BaselineMethod, build_method, capture_fingerprint, run_interleaved, setup_run, summarize
from specdecode.bench.store import ResultsStore, Run, new_run_id, save_run
from specdecode.io.prompts import encode_prompt, load_prompts
from specdecode.core.speculative import default_draft_tokens, max_draft_tokens


def grid(steps: list[int], topks: list[int], draft_tokens: list[int] | None) -> list[str]:
    specs = []
    for s in steps:
        for k in topks:
            if k == 1:
                specs.append(f"eagle3:steps={s},topk=1")
                continue
            most = max_draft_tokens(s, k)
            for n in (draft_tokens or [default_draft_tokens(s, k)]):
                if 2 <= n <= most:
                    specs.append(f"eagle3:steps={s},topk={k},draft_tokens={n}")
    return specs


def analyse(records: list[dict], specs: list[str]) -> dict:
    """Per config: measured speed and phases; verify cost vs tokens verified; the cost model."""
    summary = {row["method"]: row for row in summarize(records, ["baseline", *specs])}
    base_ms = statistics.median(1000 * r["elapsed_s"] / r["num_tokens"] for r in records if r["method"] == "baseline")
    configs = []
    for spec in specs:
        rs = [r for r in records if r["method"] == spec and r.get("cycles")]
        if not rs:
            continue
        cycles = sum(r["cycles"] for r in rs)
        phases = {p: sum(r["phases"][p]["ms_per_cycle"] * r["cycles"] for r in rs) / cycles
                  for p in ("draft", "verify", "extend", "other")}
        # the cost model prices a verify pass whole: its all-reduces (tensor parallel) included
        phases["verify"] += sum(r["phases"].get("allreduce", {}).get("ms_per_cycle", 0) * r["cycles"]
                                for r in rs) / cycles
        params = dict(kv.split("=") for kv in spec.split(":", 1)[1].split(","))
        steps, topk = int(params["steps"]), int(params["topk"])
        n_verify = int(params.get("draft_tokens", steps + 1))
        depth = len(rs[0]["per_position_accept"])
        per_pos = [sum(r["per_position_accept"][i] * r["cycles"] for r in rs) / cycles for i in range(depth)]
        configs.append({
            "method": spec, "num_steps": steps, "topk": topk, "tokens_verified": n_verify,
            "tok_per_s": summary[spec]["tok_per_s_median"], "speedup": summary[spec]["speedup"],
            "speedup_ci95": summary[spec]["speedup_ci95"], "accept_length": summary[spec].get("accept_length"),
            "per_position_accept": per_pos, "phases_ms": phases,
            "outputs_match_baseline": summary[spec]["outputs_match_baseline"],
        })
    # cost model: verify ms by tokens verified; draft ms per draft forward (steps - 1 per cycle)
    verify_ms = {}
    for c in configs:
        verify_ms.setdefault(c["tokens_verified"], []).append(c["phases_ms"]["verify"])
    verify_ms = {n: statistics.median(v) for n, v in sorted(verify_ms.items())}
    # Per branching factor (a chain is topk 1): acceptance by depth from the deepest
    # configuration of that topk, draft cost per extra step, verify cost by tokens verified.
    # (For trees this approximates: a shallower tree keeps a different candidate set.)
    for k in sorted({c["topk"] for c in configs}):
        group = [c for c in configs if c["topk"] == k]
        deepest = max(group, key=lambda c: (c["num_steps"], c["tokens_verified"]))
        per_step = [c["phases_ms"]["draft"] / (c["num_steps"] - 1) for c in group if c["num_steps"] > 1]
        draft_step_ms = statistics.median(per_step) if per_step else 0.0
        fixed_ms = statistics.median(c["phases_ms"]["extend"] + c["phases_ms"]["other"] for c in group)
        for c in group:
            d = c["num_steps"]
            expected_len = 1 + sum(deepest["per_position_accept"][:d])
            cycle = draft_step_ms * (d - 1) + verify_ms[c["tokens_verified"]] + fixed_ms
            c["predicted_accept_length"] = expected_len
            c["predicted_speedup"] = expected_len * base_ms / cycle
    best = max(configs, key=lambda c: c["speedup"]) if configs else None
    return {"baseline_ms_per_token": base_ms, "configs": configs, "verify_ms_by_tokens": verify_ms,
            "best": best["method"] if best else None}


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.plot(*zip(*pts), marker="o", label=f"topk={k}")
    ax.axhline(1000 / result["baseline_ms_per_token"], color="gray", ls="--", label="baseline")
    ax.set(xlabel="num_steps (draft depth)", ylabel="tok/s (median)", title="Throughput vs draft steps")
    ax.legend()
    save(fig, "tok_s_vs_steps.png")

    fig, ax = plt.subplots(figsize=(max(6, len(configs) * 0.8), 4))
    bottom = [0.0] * len(configs)
    for phase in ("draft", "verify", "extend", "other"):
        vals = [c["phases_ms"][phase] for c in configs]
        ax.bar(range(len(configs)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
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


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_list, default=[1, 2, 3, 4, 5, 6], help="num_steps values, e.g. 1,2,3,4")
    p.add_argument("--topk", type=int_list, default=[1], help="topk values, e.g. 1,2,4")
    p.add_argument("--draft-tokens", type=int_list, default=None, help="num_draft_tokens values for topk > 1")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--prompts", default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtypes", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=None,
                   help="sweep these dtypes too, e.g. float32,bfloat16 (default: --dtype)")
    p.add_argument("--threads-grid", type=int_list, default=None,
                   help="sweep these thread counts too, e.g. 1,2 (default: --threads)")
    p.add_argument("--out", default="sweep", help="directory for sweep.json and the PNG plots")
    p.add_argument("--store", default=None, help="SQLite results store (default: $SPECDECODE_RESULTS_DB or "
                                                 "~/.local/share/specdecode/results.db)")
    p.add_argument("--no-store", action="store_true", help="do not append the run to the results store")


def cmd_sweep(args: argparse.Namespace) -> int:
    """One sweep per (dtype, threads) setting; each is its own interleaved measurement with its own
    baseline (settings cannot be interleaved: a model is loaded per dtype). With several settings
    the outputs go to OUT/DTYPE-Nt/ and a last table compares the settings' best points."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    settings = [(d, t) for d in (args.dtypes or [args.dtype]) for t in (args.threads_grid or [args.threads])]
    bests = []
    for dtype_name, threads in settings:
        one = argparse.Namespace(**vars(args) | {"dtype": dtype_name, "threads": threads})
        sub = None if len(settings) == 1 else f"{dtype_name}-{threads}t"
        result = sweep_one(one, Path(args.out) / sub if sub else Path(args.out), console)
        if result["best"]:
            best = next(c for c in result["configs"] if c["method"] == result["best"])
            bests.append((f"{dtype_name}, {result['threads']} threads", 1000 / result["baseline_ms_per_token"], best))
    if len(settings) > 1 and bests:
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


def sweep_one(args: argparse.Namespace, out: Path, console) -> dict:
    from rich.console import Console
    from rich.table import Table

    threads, device, dtype, loaded, session = setup_run(args)
    specs = grid(args.steps, args.topk, args.draft_tokens)
    drafters: dict = {}
    methods = [BaselineMethod("baseline", loaded)] + [
        build_method(s, session, args.drafter, drafters) for s in specs]
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    encoded = [encode_prompt(p, loaded.tokenizer) for p in prompts]
    fingerprint = capture_fingerprint(args, threads, device, loaded, list(drafters))
    records = run_interleaved(methods, prompts, encoded, args.max_new_tokens, args.runs, args.warmup, console)
    result = analyse(records, specs)
    from specdecode.runtime.tp import is_main_process

    if not is_main_process():  # tensor parallel: rank 0 writes for all
        return result
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = [str(p) for p in plot(result, out)]
    result["threads"], result["dtype"], result["fingerprint"] = threads, args.dtype, fingerprint
    (out / "sweep.json").write_text(json.dumps(result | {"records": records}, indent=1))
    if not args.no_store:
        run = Run(new_run_id(), "sweep", time.strftime("%Y-%m-%d %H:%M:%S"), fingerprint,
                  summarize(records, ["baseline"] + specs), records,
                  {k: v for k, v in result.items() if k != "fingerprint"})
        save_run(run, ResultsStore(args.store), None, console)

    table = Table(title=f"sweep: {len(prompts)} prompts, {args.dtype}, {threads} threads; baseline "
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
    best = next((c for c in result["configs"] if c["method"] == result["best"]), None)
    if best and "predicted_speedup" in best:
        gap = best["predicted_speedup"] / best["speedup"] - 1
        console.print(f"at the optimum the cost model predicted {best['predicted_speedup']:.2f}x against "
                      f"{best['speedup']:.2f}x measured ({100 * gap:+.1f}%)")
    console.print(f"best: {result['best']}; verify ms by tokens verified: "
                  + ", ".join(f"{n}: {v:.1f}" for n, v in result["verify_ms_by_tokens"].items()))
    console.print(f"wrote {out / 'sweep.json'} and {len(result['plots'])} plots")
    return result
