"""Greedy losslessness of speculative decoding: speculative output must equal the baseline's
token for token. Verifying k tokens in one pass rounds differently from one-at-a-time decoding,
so a flip is acceptable only at a true near-tie: for every divergence we report the position
and the target's top-2 logit gap there, and count it as a bug when the gap exceeds the
tolerance. ``specdecode check`` is a front end to ``check_lossless``; tests and the sweep call
it too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.core.engine import BaselineDecoder, Engine, TokenDecoder
from specdecode.core.model import Transformer
from specdecode.core.requests import GenerateOptions, Tokenizer
from specdecode.core.runner import EAGER, StepRunner
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig

DEFAULT_TOLERANCE = 1e-3  # fp32: a larger top-2 gap at a divergence is a bug, not rounding
# The largest top-2 logit gap at which a divergence counts as rounding, per dtype. bf16: 0.5,
# from a measurement (benchmarks/results/early/: the shipped drafter, 1 step,
# top-2, on 78 Spec-Bench prompts x 64 tokens): 40 runs diverged, every one at a gap of at most
# 0.25, two bf16 rounding steps at logits of 16-32; 0.5 leaves twice that.
TOLERANCES = {torch.float64: DEFAULT_TOLERANCE, torch.float32: DEFAULT_TOLERANCE, torch.bfloat16: 0.5}


def default_tolerance(dtype: torch.dtype) -> float:
    """The measured near-tie tolerance of ``dtype`` (see ``TOLERANCES``)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no measured near-tie tolerance for {dtype}; pass one explicitly (--tolerance)")
    return TOLERANCES[dtype]


def top2_gap(model: Transformer, ids: Sequence[int]) -> tuple[float, list[int]]:
    """Logit gap between the best two next tokens after ``ids`` (one full forward)."""
    device = model.device
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)], device=device), torch.arange(len(ids), device=device),
                       model.new_cache(1, len(ids)), logits_at=torch.tensor([-1], device=device)).logits
    top = logits[0, -1].float().topk(2)
    return float(top.values[0] - top.values[1]), [int(i) for i in top.indices.tolist()]


def compare_outputs(model: Transformer, prompt_ids: Sequence[int], base: Sequence[int],
                    spec: Sequence[int]) -> dict[str, Any]:
    """``{"identical": True}``, or the first divergence with the top-2 logit gap there."""
    n = min(len(base), len(spec))
    first = next((i for i in range(n) if base[i] != spec[i]), None)
    if first is None and len(base) == len(spec):
        return {"identical": True}
    if first is None:  # one stopped earlier (EOS vs budget): a difference at index n
        first = n
    gap, top2 = top2_gap(model, list(prompt_ids) + list(base[:first]))
    return {"identical": False, "first_divergence": first, "top2_gap": gap, "top2": top2,
            "baseline_token": base[first] if first < len(base) else None,
            "spec_token": spec[first] if first < len(spec) else None}


@dataclass
class LosslessReport:
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per prompt (ids, counts, divergence)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def diverged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r["identical"]]

    @property
    def bugs(self) -> list[dict[str, Any]]:
        """Divergences at a top-2 gap above the tolerance: not explained by rounding."""
        return [r for r in self.diverged if r["top2_gap"] > self.tolerance]

    @property
    def identical(self) -> int:
        return len(self.rows) - len(self.diverged)

    @property
    def mean_accept_length(self) -> float | None:
        values = [r["accept_length"] for r in self.rows if r.get("accept_length") is not None]
        return sum(values) / len(values) if values else None

    @property
    def passed(self) -> bool:
        return not self.bugs

    def agreement(self) -> dict[str, Any]:
        """How far speculative output agrees with the baseline, for any dtype: prompts identical,
        where the others first diverged (token index, mean and median), and the target's top-2
        logit gap there (median and max: how close to a tie each flip was)."""
        diverged = self.diverged
        firsts = sorted(r["first_divergence"] for r in diverged)
        gaps = sorted(r["top2_gap"] for r in diverged)
        tokens = sum(r["num_tokens"] for r in self.rows)
        return {"prompts": len(self.rows), "identical": self.identical, "tokens": tokens,
                "mean_first_divergence": statistics.fmean(firsts) if firsts else None,
                "median_first_divergence": statistics.median(firsts) if firsts else None,
                "median_top2_gap": statistics.median(gaps) if gaps else None,
                "max_top2_gap": gaps[-1] if gaps else None,
                "tolerance": self.tolerance, "above_tolerance": len(self.bugs)}


def self_draft_decoder(model: Transformer, config: SpecConfig,
                       runner: StepRunner = EAGER) -> Callable[[Sequence[int]], TokenDecoder]:
    """Per prompt: EAGLE-3 with the target drafting for itself (every proposal must be accepted)."""
    return lambda ids: Eagle3Decoder(SelfDrafter(model, model, ids[0]), config, runner=runner)


def check_lossless(model: Transformer, tokenizer: Tokenizer, decoder_for: Callable[[Sequence[int]], TokenDecoder],
                   prompts: Sequence[tuple[str, str, Sequence[int]]], max_new_tokens: int = 64,
                   tolerance: float | None = None, on_prompt: Callable[[dict[str, Any]], None] | None = None,
                   runner: StepRunner = EAGER) -> LosslessReport:
    """Greedy baseline vs speculative decoding on each ``(prompt_id, category, token_ids)``;
    ``decoder_for(ids)`` gives the speculative decoder of a prompt (``lambda ids: decoder``, or
    ``self_draft_decoder(...)``, whose drafter depends on the prompt). ``tolerance``: the largest
    top-2 gap at a divergence that counts as rounding (default: the model dtype's, ``TOLERANCES``); ``runner``:
    the baseline's steps (the speculative decoder's own in each decoder)."""
    options = GenerateOptions(max_new_tokens=max_new_tokens)
    base_engine = Engine(model, tokenizer, BaselineDecoder(runner=runner))
    report = LosslessReport(tolerance=default_tolerance(model.dtype) if tolerance is None else tolerance)
    for prompt_id, category, ids in prompts:
        base = base_engine.generate(ids, options)
        spec = Engine(model, tokenizer, decoder_for(ids)).generate(ids, options)
        row: dict[str, Any] = {"prompt_id": prompt_id, "category": category, "num_tokens": base.num_tokens,
               "accept_length": spec.stats.get("accept_length")}
        row |= compare_outputs(model, ids, base.token_ids, spec.token_ids)
        report.rows.append(row)
        if on_prompt:
            on_prompt(row)
    return report
