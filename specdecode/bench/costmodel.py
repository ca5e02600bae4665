"""The sweep's analysis: per configuration, measured speed and phases; verify cost as a
function of tokens verified; and a cost model that predicts each configuration's speedup
from measurements of the same run.

Per-position acceptance (from the deepest configuration of each branching factor) gives
the expected accept length of each depth, and the measured per-cycle costs (draft ms per
step, verify ms as a function of tokens verified, re-extend and overhead) give the cycle
time. The formula is ``core.costmodel``'s, the one ``--spec-config auto`` chooses by. (How close
it came at the measured optimum: ``SpecConfig``'s docstring.)
"""

from __future__ import annotations

import statistics

from specdecode.bench.methods import method_spec_config
from specdecode.bench.output import summarize
from specdecode.core.costmodel import expected_accept_length, monotone_fit, predicted_speedup

PHASES = ("draft", "verify", "extend", "other")


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
        phases = {p: sum(r["phases"][p]["ms_per_cycle"] * r["cycles"] for r in rs) / cycles for p in PHASES}
        # the cost model prices a verify pass whole: its all-reduces (tensor parallel) included
        phases["verify"] += sum(r["phases"].get("allreduce", {}).get("ms_per_cycle", 0) * r["cycles"]
                                for r in rs) / cycles
        config = method_spec_config(spec)
        depth = len(rs[0]["per_position_accept"])
        per_pos = [sum(r["per_position_accept"][i] * r["cycles"] for r in rs) / cycles for i in range(depth)]
        configs.append({
            "method": spec, "num_steps": config.num_steps, "topk": config.topk,
            "tokens_verified": config.num_draft_tokens,
            "tok_per_s": summary[spec]["tok_per_s_median"], "speedup": summary[spec]["speedup"],
            "speedup_ci95": summary[spec]["speedup_ci95"], "accept_length": summary[spec].get("accept_length"),
            "per_position_accept": per_pos, "phases_ms": phases,
            "outputs_match_baseline": summary[spec]["outputs_match_baseline"],
        })
    verify_ms = verify_cost(configs)
    predict(configs, verify_ms, base_ms)
    best = max(configs, key=lambda c: c["speedup"]) if configs else None
    return {"baseline_ms_per_token": base_ms, "configs": configs, "verify_ms_by_tokens": verify_ms,
            "best": best["method"] if best else None}


def verify_cost(configs: list[dict]) -> dict[int, float]:
    """Target verify ms per cycle by tokens verified: the fit ``--spec-config auto`` reads
    (``core.costmodel.monotone_fit``: medians by count, non-decreasing)."""
    by_tokens: dict[int, list[float]] = {}
    for c in configs:
        by_tokens.setdefault(c["tokens_verified"], []).append(c["phases_ms"]["verify"])
    return monotone_fit(by_tokens)


def predict(configs: list[dict], verify_ms: dict[int, float], base_ms: float) -> None:
    """Add ``predicted_accept_length`` and ``predicted_speedup`` to each config.

    Per branching factor (a chain is topk 1): acceptance by depth from the deepest
    configuration of that topk, draft cost per extra step (steps - 1 draft forwards per
    cycle), verify cost by tokens verified. (For trees this approximates: a shallower tree
    keeps a different candidate set.)"""
    for k in sorted({c["topk"] for c in configs}):
        group = [c for c in configs if c["topk"] == k]
        deepest = max(group, key=lambda c: (c["num_steps"], c["tokens_verified"]))
        per_step = [c["phases_ms"]["draft"] / (c["num_steps"] - 1) for c in group if c["num_steps"] > 1]
        draft_step_ms = statistics.median(per_step) if per_step else 0.0
        fixed_ms = statistics.median(c["phases_ms"]["extend"] + c["phases_ms"]["other"] for c in group)
        for c in group:
            d = c["num_steps"]
            expected_len = expected_accept_length(deepest["per_position_accept"], d)
            cycle = draft_step_ms * (d - 1) + verify_ms[c["tokens_verified"]] + fixed_ms
            c["predicted_accept_length"] = expected_len
            c["predicted_speedup"] = predicted_speedup(expected_len, cycle, base_ms)
