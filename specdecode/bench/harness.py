"""`specdecode bench`: decoding methods compared on the same prompts, interleaved.

Every method runs on the same prompt before the next prompt starts, and the method order
rotates from prompt to prompt, so machine drift hits all methods alike. Speedups are
per-prompt speed ratios against ``baseline`` (as Spec-Bench does), summarised by their
geometric mean with a bootstrap confidence interval.

The library side: ``prepare_bench(BenchConfig, Session)`` builds the methods and encodes the
prompts, ``measure(bench)`` runs them and summarises; progress is reported through an
``on_progress`` callback. Tables, progress bars and exit codes are the CLI's
(``specdecode.cli.bench``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.bench.fingerprint import capture, diff, performance_relevant
from specdecode.bench.methods import BaselineMethod, build_method, check_method, split_methods
from specdecode.bench.output import MeasureConfig, Method, summarize
from specdecode.bench.profiles import load_profile
from specdecode.bench.store import ResultsStore, load_run
from specdecode.io.prompts import Prompt, encode_prompt
from specdecode.runtime.session import Session
from specdecode.runtime.weights import weight_format

Progress = Callable[[], None] | None  # called once per generation (warmup included)


@dataclass(frozen=True)
class BenchConfig(MeasureConfig):
    methods: str = "baseline,hf"  # comma-separated method strings; the first is the reference
    op_profile: bool = False  # also profile aten ops over one baseline generation

    def __post_init__(self) -> None:  # a misspelt method is refused before the model loads
        for spec in split_methods(self.methods):
            check_method(spec)


def run_fingerprint(session: Session, drafter_paths: Sequence[str] = (), launch_profile: str | None = None,
                    drafter_weights: Sequence[str] = ()) -> dict:
    """The run's fingerprint (see fingerprint.py), with the launch profile and any contradiction
    between it and the live environment (``fingerprint["launch_profile"]["contradictions"]``);
    ``drafter_weights``: the drafters' weight formats (``runtime.decoders.load_session_drafter``)."""
    profile = load_profile(launch_profile).record(session.threads) if launch_profile else None
    return capture(threads=session.threads, dtype=session.dtype_name, device=str(session.device),
                   model_path=session.loaded.source, drafter_paths=sorted({p for p in drafter_paths if p != "random"}),
                   drafter_weights=sorted(set(drafter_weights)),
                   launch_profile=profile, tensor_parallel=session.world_size, weights=session.config.weights,
                   activations=session.config.activations if weight_format(session.config.weights).quantized else None,
                   kernels=session.kernels.summary(),
                   compiled="on" if session.compiled is not None else "off")


def profile_contradictions(fingerprint: dict) -> list[str]:
    """Warnings for a live environment that contradicts the run's launch profile."""
    profile = fingerprint.get("launch_profile")
    if not profile:
        return []
    return [f"WARNING: the live environment contradicts launch profile {profile['name']!r}: {c}"
            for c in profile["contradictions"]]


def op_profile(method: BaselineMethod, prompt_ids: list[int], max_new_tokens: int, rows: int = 12) -> list[dict]:
    """Self time per aten op over one baseline generation."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = method.run(prompt_ids, max_new_tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"op": e.key, "self_ms_per_token": e.self_cpu_time_total / 1000 / out.count,
             "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:rows]]


def stored_baseline(ref: str, store: ResultsStore, fingerprint: dict, allow_mismatch: bool,
                    prompt_ids: set[str]) -> tuple[str, list[dict], list[str]]:
    """(method name, records, warnings) of the baseline of a stored run, after checking that it
    was measured in an environment this run can be compared with."""
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


def run_interleaved(methods: Sequence[Method], prompts: Sequence[Prompt], encoded: list[list[int]],
                    max_new_tokens: int, runs: int, warmup: int, on_progress: Progress = None) -> list[dict]:
    """Every method on each prompt before the next prompt; the order rotates per prompt.
    ``on_progress`` is called after every generation: ``(runs * prompts + warmup) * methods`` calls."""
    advance = on_progress or (lambda: None)
    methods = list(methods)
    records = []
    for m in methods:  # compiled steps: every graph the prompts need, before anything is timed
        prepare = getattr(m, "prepare", None)
        if prepare is not None:
            prepare(encoded, max_new_tokens)
    for _ in range(warmup):
        for m in methods:
            m.run(encoded[0], min(max_new_tokens, 16))
            advance()
    for run in range(runs):
        for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            k = (i + run) % len(methods)
            for m in methods[k:] + methods[:k]:  # rotate the order: no method always goes first
                out = m.run(ids, max_new_tokens)
                n = out.count
                records.append({
                    "method": m.name, "run": run, "prompt_id": prompt.id, "category": prompt.category,
                    "prompt_tokens": len(ids), "num_tokens": n, "token_ids": out.token_ids,
                    "elapsed_s": out.elapsed_s, "ttft_s": out.ttft_s, "tok_per_s": n / out.elapsed_s,
                    **out.stats})
                advance()
    return records


def progress_total(methods: int, prompts: int, runs: int, warmup: int) -> int:
    """How many times ``run_interleaved`` calls ``on_progress``."""
    return (runs * prompts + warmup) * methods


@dataclass
class LocalBench:
    """A local benchmark ready to run: methods built, prompts loaded and encoded, fingerprint taken."""

    config: BenchConfig
    session: Session
    specs: list[str]
    methods: list[Method]
    prompts: list[Prompt]
    encoded: list[list[int]]
    fingerprint: dict

    @property
    def progress_total(self) -> int:
        return progress_total(len(self.methods), len(self.prompts), self.config.runs, self.config.warmup)


@dataclass
class BenchResult:
    specs: list[str]  # the methods in table order (a stored baseline first when there is one)
    records: list[dict]
    summary: list[dict]
    by_category: dict[str, list[dict]]
    meta: dict = field(default_factory=dict)  # model, max_new_tokens, runs, by_category[, op_profile]


def prepare_bench(config: BenchConfig, session: Session) -> LocalBench:
    specs = split_methods(config.methods)
    if len(set(specs)) != len(specs):
        raise ValueError(f"--methods lists a method twice: {config.methods}")
    drafters: dict = {}
    methods = [build_method(s, session, config.drafter, drafters) for s in specs]
    prompts = config.load_prompts()
    encoded = [encode_prompt(p, session.loaded.tokenizer) for p in prompts]
    fingerprint = run_fingerprint(session, [p for p, _ in drafters], config.launch_profile,
                                  [w for p, w in drafters if p != "random"])
    return LocalBench(config, session, specs, methods, prompts, encoded, fingerprint)


def measure(bench: LocalBench, reference: tuple[str, list[dict]] | None = None,
            on_progress: Progress = None) -> BenchResult:
    """Run the benchmark; ``reference`` = (name, records) of a stored baseline to compare against."""
    c = bench.config
    specs = ([reference[0]] if reference else []) + bench.specs
    records = (reference[1] if reference else []) + run_interleaved(
        bench.methods, bench.prompts, bench.encoded, c.max_new_tokens, c.runs, c.warmup, on_progress)
    summary = summarize(records, specs)
    categories = sorted({r["category"] for r in records})
    by_category = {cat: summarize([r for r in records if r["category"] == cat], specs) for cat in categories}
    meta = {"model": str(bench.session.loaded.source), "max_new_tokens": c.max_new_tokens, "runs": c.runs,
            "by_category": by_category,
            "spec_configs": {m.name: cfg.to_dict() for m in bench.methods
                             if (cfg := getattr(m, "spec_config", None)) is not None},
            "spec_choices": {m.name: choice.to_dict() for m in bench.methods
                             if (choice := getattr(m, "spec_choice", None)) is not None}}
    if c.op_profile:
        base = next((m for m in bench.methods if isinstance(m, BaselineMethod)), None) or BaselineMethod(
            "baseline", bench.session.loaded)
        meta["op_profile"] = op_profile(base, bench.encoded[0], c.max_new_tokens)
    return BenchResult(specs, records, summary, by_category, meta)
