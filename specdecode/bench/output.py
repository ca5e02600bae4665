"""What every bench method is: a name and ``run(prompt ids, max new tokens) -> RunOutput`` (the
tokens, the wall time, the time to the first token, and the method's own stats; ``bench.methods``
and ``bench.llamaserver`` both implement it); what every measurement shares (``MeasureConfig``), and
how its records are summarised per method (``summarize``: local and remote runs alike)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

from specdecode.bench.stats import geomean_ci
from specdecode.io.prompts import Prompt, load_prompts


@dataclass
class RunOutput:
    token_ids: list[int] | None  # None: not known (a server that sends only text)
    elapsed_s: float
    ttft_s: float
    stats: dict = field(default_factory=dict)
    num_tokens: int | None = None  # when token_ids is None: the count the server reported

    @property
    def count(self) -> int:
        return max(len(self.token_ids) if self.token_ids is not None else self.num_tokens or 0, 1)


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput: ...


@dataclass(frozen=True)
class MeasureConfig:
    """What every local measurement shares: the prompts, how long, how often."""

    prompts: str | None = None  # Spec-Bench jsonl or {"prompt": ...} jsonl; None: the built-in set
    num_prompts: int | None = None  # only the first N prompts
    per_category: int | None = None  # the first N prompts of each category
    max_prompt_words: int | None = None  # only prompts of at most N words (before the two above)
    max_new_tokens: int = 128
    runs: int = 1  # passes over the prompt set
    warmup: int = 1  # untimed runs per method before measuring
    drafter: str | None = None  # drafter for eagle3 methods (None: the shipped one)
    launch_profile: str | None = None  # the launch profile applied (recorded in the fingerprint)

    def load_prompts(self) -> list[Prompt]:
        return load_prompts(self.prompts, self.num_prompts, self.per_category, self.max_prompt_words)


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
                if r["token_ids"] is not None and b["token_ids"] is not None:
                    matches.append(r["token_ids"] == b["token_ids"])
        speedup, lo, hi = geomean_ci(ratios)
        rows.append({
            "method": m, "samples": len(rs),
            "tok_per_s_median": statistics.median(speeds), "tok_per_s_min": min(speeds),
            "tok_per_s_max": max(speeds),
            "ms_per_token_median": statistics.median(1000 * r["elapsed_s"] / r["num_tokens"] for r in rs),
            "ttft_ms_median": statistics.median(1000 * r["ttft_s"] for r in rs),
            # time per output token after the first (prefill excluded): what serving overhead adds to
            "tpot_ms_median": statistics.median(1000 * (r["elapsed_s"] - r["ttft_s"]) / max(r["num_tokens"] - 1, 1)
                                                for r in rs),
            "speedup": speedup, "speedup_ci95": [lo, hi],
            "outputs_match_baseline": f"{sum(matches)}/{len(matches)}" if matches else "n/a",
        })
        spec = [r for r in rs if r.get("cycles")]
        if spec:
            cycles = sum(r["cycles"] for r in spec)
            rows[-1]["accept_length"] = sum(r["accept_length"] * r["cycles"] for r in spec) / cycles
            rates = [r["accept_rate"] for r in spec if "accept_rate" in r]  # a method may not count its drafts
            if rates:
                rows[-1]["accept_rate"] = statistics.fmean(rates)
    return rows
