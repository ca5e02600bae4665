"""`specdecode bench`: decoding methods compared on the same prompts, interleaved.

Every method runs on the same prompt before the next prompt starts, and the method order
rotates from prompt to prompt, so machine drift hits all methods alike. Speedups are
per-prompt speed ratios against ``baseline`` (as Spec-Bench does), summarised by their
geometric mean with a bootstrap confidence interval.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdecode.bench.compare import bootstrap_ci
from specdecode.core.engine import Engine, GenerateOptions
from specdecode.io.loading import LoadedModel, load_model, parse_dtype
from specdecode.io.prompts import encode_prompt, load_prompts
from specdecode.runtime.device import configure_threads, resolve_device, synchronize


@dataclass
class RunOutput:
    token_ids: list[int]
    elapsed_s: float
    ttft_s: float
    stats: dict = field(default_factory=dict)


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput: ...


class BaselineMethod:
    """Our non-speculative decode: the reference every speedup is measured against
    (or, given a decoder, any engine decoder: EAGLE-3 configurations)."""

    def __init__(self, name: str, loaded: LoadedModel, decoder=None) -> None:
        self.name = name
        self.engine = Engine(loaded.model, loaded.tokenizer, decoder) if decoder else Engine(
            loaded.model, loaded.tokenizer)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        r = self.engine.generate(prompt_ids, GenerateOptions(max_new_tokens=max_new_tokens))
        return RunOutput(r.token_ids, r.elapsed_s, r.ttft_s, r.stats)


class HFMethod:
    """transformers' greedy ``generate`` on the same GGUF, dtype and threads (outside reference)."""

    def __init__(self, name: str, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        self.device = device
        src = loaded.source
        kwargs = {"gguf_file": src.name} if src.is_file() else {}
        path = src.parent if src.is_file() else src
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs).to(device).eval()
        self.eos = list(loaded.tokenizer.eos_token_ids)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        from transformers.generation.streamers import BaseStreamer

        first: list[float] = []

        class FirstToken(BaseStreamer):
            calls = 0

            def put(self, value):
                FirstToken.calls += 1
                if FirstToken.calls == 2:  # the first call carries the prompt
                    first.append(time.perf_counter())

            def end(self):
                pass

        x = torch.tensor([prompt_ids], device=self.device)
        synchronize(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos[0],
                                      streamer=FirstToken())
        synchronize(self.device)
        elapsed = time.perf_counter() - t0
        return RunOutput(out[0, len(prompt_ids):].tolist(), elapsed, (first[0] if first else t0 + elapsed) - t0)


def split_methods(text: str) -> list[str]:
    """Split ``--methods`` on commas that start a new method (``eagle3:steps=2,topk=1,hf``)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if out and "=" in part and ":" not in part:
            out[-1] += "," + part  # a parameter of the method before
        else:
            out.append(part)
    return out


def parse_method(spec: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name:key=value,key=value``."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params


EAGLE3_KEYS = {"steps": "num_steps", "topk": "topk", "draft_tokens": "num_draft_tokens"}


def build_method(spec: str, session, drafter_path: str | None = None, drafters: dict | None = None) -> Method:
    """``baseline``, ``hf``, or ``eagle3[:steps=S,topk=K,draft_tokens=N,drafter=PATH]``."""
    loaded, dtype, device = session.loaded, session.dtype, session.device
    name, params = parse_method(spec)
    if name in ("baseline", "hf") and params:
        raise ValueError(f"method {name!r} takes no parameters (got {params})")
    if name == "baseline":
        return BaselineMethod(spec, loaded)
    if name == "hf":
        return HFMethod(spec, loaded, dtype, device)
    if name == "eagle3":
        from specdecode.core.speculative import SpecConfig
        from specdecode.runtime.decoders import DecoderSpec, build_decoder

        unknown = set(params) - set(EAGLE3_KEYS) - {"drafter"}
        if unknown:
            raise ValueError(f"method {spec!r}: unknown parameter(s) {sorted(unknown)}; "
                             f"use {', '.join(EAGLE3_KEYS)}, drafter")
        try:
            kwargs = {EAGLE3_KEYS[k]: int(v) for k, v in params.items() if k in EAGLE3_KEYS}
        except ValueError:
            raise ValueError(f"method {spec!r}: steps, topk and draft_tokens must be integers") from None
        decoder = build_decoder(DecoderSpec(drafter=params.get("drafter") or drafter_path,
                                            config=SpecConfig(**kwargs)), session, drafters)
        if not decoder.is_speculative:
            raise ValueError(f"method {spec!r} needs a drafter: pass --drafter PATH (or drafter=random)")
        return BaselineMethod(spec, loaded, decoder.decode)
    raise ValueError(f"unknown method {name!r}; available: baseline, hf, eagle3[:steps=S,topk=K,draft_tokens=N]")


def capture_fingerprint(args: argparse.Namespace, threads: int, device: torch.device, loaded: LoadedModel,
                        drafter_paths: list[str] = ()) -> dict:
    """The run's fingerprint (see fingerprint.py), with the launch profile and any contradiction
    between it and the live environment, which is also printed."""
    from specdecode.bench.fingerprint import capture
    from specdecode.bench.profiles import load_profile

    profile = None
    if getattr(args, "launch_profile", None):
        profile = load_profile(args.launch_profile).record(threads)
        for c in profile["contradictions"]:
            print(f"WARNING: the live environment contradicts launch profile {profile['name']!r}: {c}",
                  file=sys.stderr)
    return capture(threads=threads, dtype=str(parse_dtype(args.dtype)).removeprefix("torch."), device=str(device),
                   model_path=loaded.source, drafter_paths=sorted(p for p in drafter_paths if p != "random"),
                   launch_profile=profile)


def geomean_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of speed ratios with its bootstrap 95% CI."""
    logs = [math.log(r) for r in ratios]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    return (math.exp(statistics.fmean(logs)), *bootstrap_ci(logs))


def summarize(records: list[dict], methods: list[str]) -> list[dict]:
    base = {(r["prompt_id"], r["run"]): r for r in records if r["method"] == methods[0]}
    base_any = {pid: r for (pid, _), r in sorted(base.items(), key=lambda kv: -kv[0][1])}  # run 0 wins
    rows = []
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        speeds = [r["tok_per_s"] for r in rs]
        ratios, matches = [], []
        for r in rs:
            b = base.get((r["prompt_id"], r["run"])) or base_any.get(r["prompt_id"])
            if b:
                ratios.append(r["tok_per_s"] / b["tok_per_s"])
                matches.append(r["token_ids"] == b["token_ids"])
        speedup, lo, hi = geomean_ci(ratios)
        rows.append({
            "method": m, "samples": len(rs),
            "tok_per_s_median": statistics.median(speeds), "tok_per_s_min": min(speeds),
            "tok_per_s_max": max(speeds),
            "ms_per_token_median": statistics.median(1000 * r["elapsed_s"] / r["num_tokens"] for r in rs),
            "ttft_ms_median": statistics.median(1000 * r["ttft_s"] for r in rs),
            "speedup": speedup, "speedup_ci95": [lo, hi],
            "outputs_match_baseline": f"{sum(matches)}/{len(matches)}",
        })
        spec = [r for r in rs if r.get("cycles")]
        if spec:
            cycles = sum(r["cycles"] for r in spec)
            rows[-1]["accept_length"] = sum(r["accept_length"] * r["cycles"] for r in spec) / cycles
            rows[-1]["accept_rate"] = statistics.fmean(r["accept_rate"] for r in spec)
    return rows


def op_profile(method: BaselineMethod, prompt_ids: list[int], max_new_tokens: int, rows: int = 12) -> list[dict]:
    """Self time per aten op over one baseline generation."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = method.run(prompt_ids, max_new_tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"op": e.key, "self_ms_per_token": e.self_cpu_time_total / 1000 / len(out.token_ids),
             "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:rows]]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="baseline,hf",
                   help="comma-separated methods; the first is the reference for speedups. Available: baseline, "
                        "hf (transformers generate), eagle3[:steps=S,topk=K,draft_tokens=N,drafter=PATH], e.g. "
                        "'baseline,eagle3:steps=2,topk=1,eagle3:steps=5,topk=4,draft_tokens=16'")
    p.add_argument("--drafter", default=None, help="drafter for eagle3 methods (default: the shipped one)")
    p.add_argument("--prompts", default=None,
                   help="Spec-Bench jsonl (turns, category) or jsonl of {\"prompt\": ...} (default: built-in set)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--per-category", type=int, default=None, help="use the first N prompts of each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per method before measuring")
    p.add_argument("--runs", type=int, default=1, help="passes over the prompt set")
    p.add_argument("--out", default=None,
                   help="also write the run to FILE: .jsonl appends a run line and one line per record; "
                        "other names get one JSON document")
    p.add_argument("--store", default=None, help="SQLite results store (default: $SPECDECODE_RESULTS_DB or "
                                                 "~/.local/share/specdecode/results.db)")
    p.add_argument("--no-store", action="store_true", help="do not append the run to the results store")
    p.add_argument("--baseline-from", default=None, metavar="RUN",
                   help="take the baseline from a stored run (id, prefix, 'latest' or results file) instead of "
                        "measuring it; refused when that run's environment differs in a performance-relevant way")
    p.add_argument("--allow-env-mismatch", action="store_true",
                   help="with --baseline-from: compare anyway, with a loud warning and the differences recorded")
    p.add_argument("--op-profile", action="store_true",
                   help="also profile aten ops over one baseline generation and print the top ops")
    r = p.add_argument_group("remote mode (any OpenAI-compatible server: ours, SGLang, vLLM, llama.cpp)")
    r.add_argument("--endpoint", default=None, metavar="URL",
                   help="measure the server at URL over streaming instead of a local model: TTFT, TPOT, ITL, "
                        "output tok/s, failures, and the server's own speculative metrics")
    r.add_argument("--endpoint-model", default=None, help="model name to request (default: the first of /v1/models)")
    r.add_argument("--api", choices=("chat", "completions"), default="chat")
    r.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    r.add_argument("--api-key", default=None, help="bearer token (default: $SPECDECODE_API_KEY or $OPENAI_API_KEY)")
    r.add_argument("--temperature", type=float, default=0.0)


def stored_baseline(ref: str, store, fingerprint: dict, allow_mismatch: bool, prompt_ids: set[str]) -> tuple[
        str, list[dict], list[str]]:
    """(method name, records, warnings) of the baseline of a stored run, after checking that it
    was measured in an environment this run can be compared with."""
    from specdecode.bench.fingerprint import diff, performance_relevant
    from specdecode.bench.store import load_run

    run = load_run(ref, store)
    records = [r for r in run.records if r.get("method") == "baseline" and str(r.get("prompt_id")) in prompt_ids]
    if not records:
        raise ValueError(f"run {run.run_id} has no 'baseline' records for these prompts: measure the baseline in "
                         f"this run instead (drop --baseline-from)")
    relevant = performance_relevant(diff(run.fingerprint, fingerprint))
    lines = [f"  {d}   [{d.why}]" for d in relevant]
    high = [d for d in relevant if d.impact >= 3]
    if high and not allow_mismatch:
        raise ValueError(
            f"refusing to use the baseline of run {run.run_id}: it was measured in an environment that differs in "
            f"performance-relevant ways:\n" + "\n".join(lines) + "\nRe-measure the baseline in this run (drop "
            "--baseline-from), restore that environment (e.g. --launch-profile), or pass --allow-env-mismatch.")
    warnings = ([f"WARNING: baseline from run {run.run_id} was measured in a different environment:"] + lines
                if relevant else [])
    name = f"baseline@{run.run_id}"
    return name, [r | {"method": name} for r in records], warnings


def run_interleaved(methods: list, prompts: list, encoded: list[list[int]], max_new_tokens: int, runs: int,
                    warmup: int, console) -> list[dict]:
    """Every method on each prompt before the next prompt; the order rotates per prompt."""
    from rich.progress import Progress

    records = []
    total = (runs * len(prompts) + warmup) * len(methods)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=total)
        for _ in range(warmup):
            for m in methods:
                m.run(encoded[0], min(max_new_tokens, 16))
                progress.advance(task)
        for run in range(runs):
            for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
                k = (i + run) % len(methods)
                for m in methods[k:] + methods[:k]:  # rotate the order: no method always goes first
                    out = m.run(ids, max_new_tokens)
                    n = max(len(out.token_ids), 1)
                    records.append({
                        "method": m.name, "run": run, "prompt_id": prompt.id, "category": prompt.category,
                        "prompt_tokens": len(ids), "num_tokens": n, "token_ids": out.token_ids,
                        "elapsed_s": out.elapsed_s, "ttft_s": out.ttft_s, "tok_per_s": n / out.elapsed_s,
                        **out.stats})
                    progress.advance(task)
    return records


def setup_run(args: argparse.Namespace):
    """Threads, device, dtype and the loaded model, as every measuring command sets them."""
    from specdecode.runtime.session import RuntimeConfig, start

    session = start(RuntimeConfig(args.model, args.dtype, args.device, args.threads))
    return session.threads, session.device, session.dtype, session.loaded, session


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdecode.bench.store import ResultsStore, Run, new_run_id, save_run

    console = Console(stderr=True)
    if args.endpoint:
        return bench_remote(args, console)
    threads, device, dtype, loaded, session = setup_run(args)
    specs = split_methods(args.methods)
    if len(set(specs)) != len(specs):
        raise ValueError(f"--methods lists a method twice: {args.methods}")
    drafters: dict = {}
    methods = [build_method(s, session, args.drafter, drafters) for s in specs]
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    encoded = [encode_prompt(p, loaded.tokenizer) for p in prompts]
    fingerprint = capture_fingerprint(args, threads, device, loaded, list(drafters))
    store = None if args.no_store else ResultsStore(args.store)

    reference: list[dict] = []
    warnings: list[str] = []
    if args.baseline_from:
        name, reference, warnings = stored_baseline(args.baseline_from, store or ResultsStore(args.store),
                                                     fingerprint, args.allow_env_mismatch, {p.id for p in prompts})
        specs = [name] + specs
        fingerprint["baseline_from"] = {"run": name.split("@", 1)[1], "warnings": warnings}
    for w in warnings:
        console.print(w, style="bold red", markup=False, highlight=False)

    records = reference + run_interleaved(methods, prompts, encoded, args.max_new_tokens, args.runs, args.warmup,
                                          console)
    summary = summarize(records, specs)
    categories = sorted({r["category"] for r in records})
    by_category = {c: summarize([r for r in records if r["category"] == c], specs) for c in categories}
    from specdecode.runtime.tp import world

    tp = world()[1]
    title = (f"specdecode bench: {len(prompts)} prompts x {args.runs} runs, {args.max_new_tokens} new tokens, "
             f"{dtype}, {threads} threads{f' per rank, tensor parallel {tp}' if tp > 1 else ''}, {device}")
    out = Console(width=170) if not sys.stdout.isatty() else Console()
    out.print(summary_table(title, summary))
    if len(categories) > 1:
        out.print(category_table(by_category, specs))

    meta = {"model": str(loaded.source), "max_new_tokens": args.max_new_tokens, "runs": args.runs,
            "by_category": by_category}
    if args.op_profile:
        base = next((m for m in methods if isinstance(m, BaselineMethod)), None) or BaselineMethod(
            "baseline", loaded)
        meta["op_profile"] = op_profile(base, encoded[0], args.max_new_tokens)
        out.print(op_table(meta["op_profile"]))
    save_run(Run(new_run_id(), "bench", time.strftime("%Y-%m-%d %H:%M:%S"), fingerprint, summary, records, meta),
             store, args.out, console)
    for w in warnings:  # again at the end, where the eye lands
        console.print(w, style="bold red", markup=False, highlight=False)
    return 0


def bench_remote(args: argparse.Namespace, console) -> int:
    """``bench --endpoint``: the same prompts, runs, table and store, over HTTP streaming."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specdecode.bench.fingerprint import capture
    from specdecode.bench.remote import RemoteError, measure_endpoint
    from specdecode.bench.store import ResultsStore, Run, new_run_id, save_run

    if args.baseline_from or args.op_profile:
        raise ValueError("--baseline-from and --op-profile measure a local model; drop them with --endpoint")
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    api_key = args.api_key or os.environ.get("SPECDECODE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    fingerprint = capture(threads=torch.get_num_threads(), dtype="(server)", device="remote") | {
        "endpoint": args.endpoint, "concurrency": args.concurrency, "api": args.api}
    records, remote = [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("requests", total=len(prompts) * args.runs)
        for run in range(args.runs):
            try:
                rr = measure_endpoint(args.endpoint, prompts, model=args.endpoint_model,
                                      max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                      api=args.api, api_key=api_key, temperature=args.temperature,
                                      warmup=args.warmup if run == 0 else 0,
                                      on_done=lambda _: progress.advance(task))
            except RemoteError as e:
                raise ValueError(f"{e} (is the server at {args.endpoint} running?)") from None
            method = f"remote:{rr.model}"
            records += rr.records(method, run)
            remote.append(rr.summary() | {"run": run})
    fingerprint["server_model"] = rr.model
    summary = summarize(records, [method]) if records else []
    for row in summary:
        row["outputs_match_baseline"] = "n/a"  # one method, its own reference
    out = Console(width=170) if not sys.stdout.isatty() else Console()
    out.print(summary_table(f"specdecode bench --endpoint {args.endpoint}: {len(prompts)} prompts x {args.runs} "
                            f"runs, {args.max_new_tokens} new tokens, concurrency {args.concurrency}", summary))
    table = Table(title="remote: per run (client-side timing; server's speculative counters as deltas)")
    for col in ("run", "ok/requests", "output tok/s", "TTFT ms med/p90/p99", "TPOT ms", "ITL ms med/p90/p99",
                "server accept len", "accept rate", "per position"):
        table.add_column(col, justify="right")
    for s in remote:
        spec = s["server_spec"] or {}
        f = lambda *keys: "/".join("-" if s[k] is None else f"{s[k]:.0f}" for k in keys)  # noqa: E731
        table.add_row(str(s["run"]), f"{s['ok']}/{s['requests']}",
                      "-" if s["output_tok_per_s"] is None else f"{s['output_tok_per_s']:.1f}",
                      f("ttft_ms_median", "ttft_ms_p90", "ttft_ms_p99"),
                      "-" if s["tpot_ms_median"] is None else f"{s['tpot_ms_median']:.1f}",
                      f("itl_ms_median", "itl_ms_p90", "itl_ms_p99"),
                      "-" if spec.get("accept_length") is None else f"{spec['accept_length']:.2f}",
                      "-" if spec.get("accept_rate") is None else f"{spec['accept_rate']:.2f}",
                      " ".join(f"{x:.2f}" for x in spec.get("per_position") or []) or
                      (s["server_spec_reason"] or "-")[:40])
    out.print(table)
    failed = sum(s["failed"] for s in remote)
    if failed:
        errors = {}
        for s in remote:
            for k, v in s["errors"].items():
                errors[k] = errors.get(k, 0) + v
        console.print(f"{failed} failed request(s): " + "; ".join(f"{v}x {k}" for k, v in errors.items()),
                      style="bold red", markup=False)
    store = None if args.no_store else ResultsStore(args.store)
    save_run(Run(new_run_id(), "bench-remote", time.strftime("%Y-%m-%d %H:%M:%S"), fingerprint, summary, records,
                 {"endpoint": args.endpoint, "max_new_tokens": args.max_new_tokens, "remote": remote}),
             store, args.out, console)
    return 0 if not failed else 1


def _fmt_speedup(row: dict) -> str:
    lo, hi = row["speedup_ci95"]
    return f"{row['speedup']:.2f}x" + ("" if math.isnan(lo) else f" ({lo:.2f}-{hi:.2f})")


SUMMARY_COLUMNS = ("tok/s median", "min", "max", "ms/token", "TTFT ms", "speedup (95% CI)", "accept len",
                   "accept rate", "same output")


def _summary_cells(row: dict) -> list[str]:
    return [f"{row['tok_per_s_median']:.1f}", f"{row['tok_per_s_min']:.1f}", f"{row['tok_per_s_max']:.1f}",
            f"{row['ms_per_token_median']:.1f}", f"{row['ttft_ms_median']:.0f}", _fmt_speedup(row),
            f"{row['accept_length']:.2f}" if "accept_length" in row else "-",
            f"{row['accept_rate']:.2f}" if "accept_rate" in row else "-", row["outputs_match_baseline"]]


def summary_table(title: str, summary: list[dict]):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("method")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="right")
    for row in summary:
        table.add_row(row["method"], *_summary_cells(row))
    return table


def category_table(by_category: dict[str, list[dict]], specs: list[str]):
    from rich.table import Table

    table = Table(title="per category")
    table.add_column("category")
    table.add_column("method")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="right")
    for c, rows in by_category.items():
        for i, row in enumerate(rows):
            table.add_row(c if i == 0 else "", row["method"], *_summary_cells(row), end_section=i == len(rows) - 1)
    return table


def op_table(ops: list[dict]):
    from rich.table import Table

    table = Table(title="baseline decode: self time per op")
    for col in ("op", "ms/token", "share", "calls"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for o in ops:
        table.add_row(o["op"], f"{o['self_ms_per_token']:.2f}", f"{100 * o['share']:.1f}%", str(o["calls"]))
    return table
