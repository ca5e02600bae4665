"""`specdecode sweep`: find the best speculative configuration by measuring, not guessing.

Every grid point runs on the same prompts, interleaved with the baseline. Beside the
measured speedup sits a prediction from a cost model built from measurements of the
same run (see costmodel.py). One sweep runs per (dtype, threads) setting, each its own
interleaved measurement with its own baseline: settings cannot be interleaved, a model is
loaded per dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.bench.costmodel import analyse
from specdecode.bench.harness import Progress, progress_total, run_fingerprint, run_interleaved
from specdecode.bench.methods import BaselineMethod, build_method, eagle3_method
from specdecode.bench.output import MeasureConfig, Method, summarize
from specdecode.bench.plots import sweep_plots
from specdecode.bench.store import Run, new_run_id, now
from specdecode.core.speculative import default_draft_tokens, max_draft_tokens
from specdecode.io.prompts import encode_prompt
from specdecode.runtime.session import RuntimeConfig, Session


@dataclass(frozen=True)
class SweepConfig(MeasureConfig):
    steps: tuple[int, ...] = (1, 2, 3, 4, 5, 6)  # num_steps values
    topk: tuple[int, ...] = (1,)  # topk values
    draft_tokens: tuple[int, ...] | None = None  # num_draft_tokens values for topk > 1 (None: the default)
    max_new_tokens: int = 96


def grid(steps: list[int], topks: list[int], draft_tokens: list[int] | None) -> list[str]:
    specs = []
    for s in steps:
        for k in topks:
            if k == 1:
                specs.append(eagle3_method(s, 1))
                continue
            most = max_draft_tokens(s, k)
            for n in (draft_tokens or [default_draft_tokens(s, k)]):
                if 2 <= n <= most:
                    specs.append(eagle3_method(s, k, n))
    return specs


def settings(runtime: RuntimeConfig, dtypes: list[str] | None,
             threads: list[int] | None) -> list[tuple[str | None, RuntimeConfig]]:
    """(output subdirectory or None, runtime) per (dtype, threads) setting; one setting: no subdirectory."""
    thread_counts: list[int | None] = list(threads) if threads else [runtime.threads]
    points = [(d, t) for d in (dtypes or [runtime.dtype]) for t in thread_counts]
    return [(None if len(points) == 1 else f"{d}-{t}t", replace(runtime, dtype=d, threads=t)) for d, t in points]


@dataclass
class SweepRun:
    """One setting's sweep: the analysis (``costmodel.analyse`` plus threads, dtype, fingerprint)
    and the records it came from."""

    result: dict
    records: list[dict]
    specs: list[str]
    prompts: int

    @property
    def best(self) -> dict | None:
        return next((c for c in self.result["configs"] if c["method"] == self.result["best"]), None)

    def to_run(self) -> Run:
        return Run(new_run_id(), "sweep", now(), self.result["fingerprint"],
                   summarize(self.records, ["baseline"] + self.specs), self.records,
                   {k: v for k, v in self.result.items() if k != "fingerprint"})


class SweepPlan:
    """A sweep ready to run on one session: methods built, prompts encoded."""

    def __init__(self, config: SweepConfig, session: Session) -> None:
        self.config, self.session = config, session
        self.specs = grid(list(config.steps), list(config.topk),
                          list(config.draft_tokens) if config.draft_tokens else None)
        drafters: dict = {}
        self.methods: list[Method] = [BaselineMethod("baseline", session.loaded)] + [
            build_method(s, session, config.drafter, drafters) for s in self.specs]
        self.prompts = config.load_prompts()
        self.encoded = [encode_prompt(p, session.loaded.tokenizer) for p in self.prompts]
        self.fingerprint = run_fingerprint(session, [p for p, _ in drafters], config.launch_profile,
                                           [w for p, w in drafters if p != "random"])

    @property
    def progress_total(self) -> int:
        return progress_total(len(self.methods), len(self.prompts), self.config.runs, self.config.warmup)

    def run(self, on_progress: Progress = None) -> SweepRun:
        c = self.config
        records = run_interleaved(self.methods, self.prompts, self.encoded, c.max_new_tokens, c.runs, c.warmup,
                                  on_progress)
        result = analyse(records, self.specs)
        result["threads"], result["dtype"] = self.session.threads, self.session.config.dtype
        result["weights"], result["format_reason"] = self.session.config.weights, self.session.format_reason
        result["fingerprint"] = self.fingerprint
        return SweepRun(result, records, self.specs, len(self.prompts))


def write_sweep(sweep: SweepRun, out: Path) -> Path:
    """Plots and ``sweep.json`` (the analysis and every record) into ``out``; the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    sweep.result["plots"] = [str(p) for p in sweep_plots(sweep.result, out)]
    path = out / "sweep.json"
    path.write_text(json.dumps(sweep.result | {"records": sweep.records}, indent=1))
    return path
