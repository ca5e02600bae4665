"""`specdecode compare A B`: did speed change, beyond noise, and which hidden variable differs?

Per method, the B/A speed ratio is the geometric mean of per-prompt ratios when both runs
measured the same prompts (paired), else the ratio of geometric-mean speeds; its p-value
comes from a sign-flip (paired) or label-permutation (unpaired) test on log tok/s, exact
when small. The environment diff is ranked by likely impact, and when results differ
beyond noise while the environments differ, that is said first.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from specdecode.bench.fingerprint import IMPACT_NAMES, Difference, diff, performance_relevant
from specdecode.bench.stats import bootstrap_ci, permutation_p, sign_flip_p
from specdecode.bench.store import Run

ALPHA = 0.05
MIN_EFFECT = 0.03  # ratios within 3% are not called a change even when "significant"


@dataclass
class MethodComparison:
    method: str
    n_a: int
    n_b: int
    paired: bool
    tok_per_s_a: float  # median
    tok_per_s_b: float
    ratio: float  # B / A
    ci95: tuple[float, float]
    p_value: float
    accept_length_a: float | None = None
    accept_length_b: float | None = None
    same_output: str | None = None  # "k/n": prompts whose token ids are identical in both runs

    @property
    def changed(self) -> bool:
        return self.p_value < ALPHA and abs(math.log(self.ratio)) > math.log1p(MIN_EFFECT)

    @property
    def testable(self) -> bool:
        """Whether the test could reach p < ALPHA at all: a paired test on n prompts cannot go
        below 2/2^n, so 4 prompts can never show a change, however large."""
        n = min(self.n_a, self.n_b)
        return (2 / 2 ** n if self.paired else 2 / math.comb(self.n_a + self.n_b, self.n_a)) < ALPHA

    @property
    def verdict(self) -> str:
        if self.changed:
            return "CHANGED"
        return "within noise" if self.testable else "too few prompts to test"


def _per_prompt(records: list[dict], method: str) -> dict[str, float]:
    """Mean log tok/s per prompt over runs."""
    logs: dict[str, list[float]] = {}
    for r in records:
        if r.get("method") == method and r.get("tok_per_s", 0) > 0:
            logs.setdefault(str(r.get("prompt_id")), []).append(math.log(r["tok_per_s"]))
    return {k: statistics.fmean(v) for k, v in logs.items()}


def _accept_length(summary: list[dict], method: str) -> float | None:
    return next((s.get("accept_length") for s in summary if s.get("method") == method), None)


def compare_method(a: Run, b: Run, method: str) -> MethodComparison | None:
    pa, pb = _per_prompt(a.records, method), _per_prompt(b.records, method)
    if not pa or not pb:
        return None
    common = sorted(pa.keys() & pb.keys())
    if len(common) >= 2:
        d = [pb[k] - pa[k] for k in common]
        ratio, ci, p, paired = math.exp(statistics.fmean(d)), bootstrap_ci(d), sign_flip_p(d), True
    else:
        la, lb = list(pa.values()), list(pb.values())
        ratio = math.exp(statistics.fmean(lb) - statistics.fmean(la))
        ci, p, paired = bootstrap_ci(lb, la), permutation_p(la, lb), False
    return MethodComparison(method, len(pa), len(pb), paired,
                            statistics.median(math.exp(v) for v in pa.values()),
                            statistics.median(math.exp(v) for v in pb.values()),
                            ratio, ci, p, _accept_length(a.summary, method), _accept_length(b.summary, method),
                            _same_output(a.records, b.records, method))


def _same_output(ra: list[dict], rb: list[dict], method: str) -> str | None:
    """Greedy outputs are a function of the code and weights, not of the environment: a
    changed output between runs is worth knowing before any speed figure."""
    ta = {(r.get("prompt_id"), r.get("run")): r.get("token_ids") for r in ra if r.get("method") == method}
    tb = {(r.get("prompt_id"), r.get("run")): r.get("token_ids") for r in rb if r.get("method") == method}
    common = [k for k in ta.keys() & tb.keys() if ta[k] and tb[k]]
    return f"{sum(ta[k] == tb[k] for k in common)}/{len(common)}" if common else None


@dataclass
class Comparison:
    a: Run
    b: Run
    methods: list[MethodComparison]
    differences: list[Difference]

    @property
    def changed(self) -> list[MethodComparison]:
        return [m for m in self.methods if m.changed]

    def headline(self) -> list[str]:
        """What to read first: a change beyond noise together with the environment's differences."""
        relevant = performance_relevant(self.differences)
        lines = []
        if self.changed and relevant:
            what = ", ".join(f"{m.method} {m.ratio:.2f}x (p={m.p_value:.3g})" for m in self.changed)
            lines.append(f"RESULTS DIFFER BEYOND NOISE ({what}) AND THE ENVIRONMENTS DIFFER. "
                         f"Most likely cause first:")
            lines += [f"  {d}   [{IMPACT_NAMES[d.impact]}: {d.why}]" for d in relevant[:5]]
        elif self.changed:
            what = ", ".join(f"{m.method} {m.ratio:.2f}x (p={m.p_value:.3g})" for m in self.changed)
            lines.append(f"Results differ beyond noise ({what}); no performance-relevant environment "
                         f"difference recorded: the code path, the prompts or the load did it.")
        elif any(not m.testable for m in self.methods):
            what = ", ".join(f"{m.method} {m.ratio:.2f}x" for m in self.methods if not m.testable)
            lines.append(f"Too few prompts to tell noise from change ({what}; a paired test needs >= 6 prompts)"
                         + ("; the environments differ: " + "; ".join(str(d) for d in relevant[:5]) if relevant
                            else ""))
        elif relevant:
            lines.append("No change beyond noise, but the environments differ: " +
                         "; ".join(str(d) for d in relevant[:5]))
        else:
            lines.append("No change beyond noise; environments match in every performance-relevant field.")
        if not self.methods:
            lines.append("The runs share no method: nothing to compare speed on.")
        return lines

    def to_dict(self) -> dict:
        return {"a": self.a.run_id, "b": self.b.run_id, "headline": self.headline(),
                "methods": [asdict(m) | {"changed": m.changed, "verdict": m.verdict} for m in self.methods],
                "environment_differences": [asdict(d) | {"impact": IMPACT_NAMES[d.impact]}
                                            for d in self.differences]}


def compare_runs(a: Run, b: Run) -> Comparison:
    methods_a = [s["method"] for s in a.summary]
    methods_b = {s["method"] for s in b.summary}
    results = [compare_method(a, b, m) for m in methods_a if m in methods_b]
    return Comparison(a, b, [r for r in results if r], diff(a.fingerprint, b.fingerprint))
