"""core.lossless.check_lossless on a tiny float64 model: identical outputs with a random drafter,
and a report that flags a decoder which deliberately differs (position and top-2 gap)."""

import torch

from specdecode.core import lossless
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import BaselineDecoder, Engine
from specdecode.core.lossless import DEFAULT_TOLERANCE, check_lossless, self_draft_decoder, top2_gap
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from tests.core.helpers import PROMPTS, DigitTokenizer
from tests.helpers import plain_steps, tiny_model

N = 16


def test_random_drafter_is_lossless():
    model = tiny_model()
    decoder = Eagle3Decoder(random_drafter(model, 60, seed=1), SpecConfig(3, 2, 6))
    seen = []
    report = check_lossless(model, DigitTokenizer(), lambda ids: decoder, PROMPTS, max_new_tokens=N,
                            on_prompt=seen.append)
    assert report.passed and not report.diverged and not report.bugs
    assert report.identical == len(report.rows) == len(PROMPTS) == len(seen)
    assert report.tolerance == DEFAULT_TOLERANCE
    for row, (pid, cat, _) in zip(report.rows, PROMPTS, strict=True):
        assert row["identical"] is True
        assert (row["prompt_id"], row["category"], row["num_tokens"]) == (pid, cat, N)
        assert row["accept_length"] >= 1.0
    assert report.mean_accept_length is not None and report.mean_accept_length >= 1.0


def test_self_draft_accepts_everything():
    model = tiny_model()
    config = SpecConfig(3, 1)
    report = check_lossless(model, DigitTokenizer(), self_draft_decoder(model, config), PROMPTS[:2], max_new_tokens=N)
    assert report.passed and report.identical == 2
    assert all(r["accept_length"] > 1.0 for r in report.rows)


def test_a_differing_decoder_is_reported_with_its_top2_gap(monkeypatch):
    model = tiny_model()
    vocab = model.config.vocab_size
    at = 5  # the token index this decoder changes (prompt p1 only)
    altered = BaselineDecoder(sync=False)  # plain decoding, marked: its output is changed below

    class Altering(Engine):  # the engine is lossless by construction: a divergence is made after it
        def generate(self, prompt_ids, options, on_chunk=None):
            result = super().generate(prompt_ids, options, on_chunk)
            if self.decoder is altered and list(prompt_ids) == PROMPTS[1][2]:
                result.token_ids[at] = (result.token_ids[at] + 1) % vocab
            return result

    monkeypatch.setattr(lossless, "Engine", Altering)

    report = check_lossless(model, DigitTokenizer(), lambda ids: altered, PROMPTS, max_new_tokens=N)
    assert report.identical == 2 and len(report.diverged) == 1
    row = report.diverged[0]
    assert row["prompt_id"] == "p1" and row["identical"] is False and row["first_divergence"] == at
    base = [t for s in plain_steps(model, PROMPTS[1][2], N, _greedy()) for t in s.tokens]
    assert row["baseline_token"] == base[at] and row["spec_token"] == (base[at] + 1) % vocab
    gap, top2 = top2_gap(model, PROMPTS[1][2] + base[:at])
    assert row["top2_gap"] == gap and row["top2"] == top2 and top2[0] == base[at]
    assert gap > DEFAULT_TOLERANCE  # not a near-tie: a bug, and the report fails
    assert report.bugs == [row] and not report.passed
    assert row["accept_length"] is None  # no speculative cycles: no accept length
    assert report.mean_accept_length is None
    # a tolerance above the gap would explain it as rounding
    lenient = check_lossless(model, DigitTokenizer(), lambda ids: altered, PROMPTS[1:2], max_new_tokens=N,
                             tolerance=gap + 1.0)
    assert len(lenient.diverged) == 1 and lenient.passed


def _greedy():
    from specdecode.core.sampling import SamplingParams

    return SamplingParams()


def test_top2_gap_is_the_logit_margin():
    model = tiny_model()
    ids = [5, 17, 3]
    gap, top2 = top2_gap(model, ids)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(3), model.new_cache(1, 3)).logits[0, -1]
    values, indices = logits.float().topk(2)  # top2_gap measures in fp32
    assert top2 == indices.tolist() and abs(gap - float(values[0] - values[1])) < 1e-12 and gap >= 0


def test_agreement_summary_and_tolerance_per_dtype():
    import pytest

    from specdecode.core.lossless import TOLERANCES, LosslessReport, default_tolerance

    assert default_tolerance(torch.float32) == DEFAULT_TOLERANCE == TOLERANCES[torch.float64]
    assert default_tolerance(torch.bfloat16) == 0.5
    with pytest.raises(ValueError, match="pass one explicitly"):
        default_tolerance(torch.float16)  # never measured: no silent guess
    rows = [{"identical": True, "num_tokens": 10},
            {"identical": False, "num_tokens": 10, "first_divergence": 3, "top2_gap": 0.125},
            {"identical": False, "num_tokens": 8, "first_divergence": 8, "top2_gap": 0.75}]
    a = LosslessReport(rows, tolerance=0.5).agreement()
    assert a == {"prompts": 3, "identical": 1, "tokens": 28, "mean_first_divergence": 5.5,
                 "median_first_divergence": 5.5, "median_top2_gap": 0.4375, "max_top2_gap": 0.75,
                 "tolerance": 0.5, "above_tolerance": 1}
    none = LosslessReport(rows[:1]).agreement()
    assert none["identical"] == 1 and none["mean_first_divergence"] is None and none["max_top2_gap"] is None


def test_check_takes_the_model_dtype_tolerance():
    model = tiny_model().to(torch.bfloat16)
    decoder = Eagle3Decoder(random_drafter(model, 60, seed=1), SpecConfig(1, 2))
    report = check_lossless(model, DigitTokenizer(), lambda ids: decoder, PROMPTS[:1], max_new_tokens=4)
    assert report.tolerance == 0.5
