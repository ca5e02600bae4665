"""The reproducibility measurement (``bench/repro.py``): on a float64 tiny model every comparison is
identical (repeat, seeded, batched, speculative vs plain), and a model whose logits change from call to
call is caught."""

from __future__ import annotations

import torch

from specdecode.bench.repro import Agreement, ReproConfig, measure
from specdecode.core.drafter import random_drafter
from specdecode.core.speculative import SpecConfig
from tests.helpers import tiny_model

PROMPTS = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 8, 1, 6], [11, 2, 30], [5]]
CFG = ReproConfig(max_new_tokens=12, repeats=2, batch=3)


def test_float64_is_reproducible_in_every_comparison():
    model = tiny_model(seed=3)
    drafter = random_drafter(model, 60, seed=1)
    plain, spec = measure(model, PROMPTS, [], drafter, SpecConfig(2, 2, 5), CFG)
    assert plain.mode == "plain" and plain.vs_plain is None and spec.vs_plain is not None
    for agreement in (plain.repeat, plain.seeded, plain.batched, spec.repeat, spec.seeded, spec.batched,
                      spec.vs_plain):
        assert (agreement.identical, agreement.prompts, agreement.first_difference) == (5, 5, []), agreement


class _Noisy(torch.nn.Module):
    """An lm_head whose logits get fresh noise on every call."""

    def __init__(self, head) -> None:
        super().__init__()
        self.head, self.noise = head, torch.Generator().manual_seed(0)

    def forward(self, x):
        out = self.head(x)
        return out + 5 * torch.randn(out.shape, generator=self.noise, dtype=out.dtype)


def test_logits_that_change_between_calls_are_caught():
    model = tiny_model(seed=3)
    model.lm_head = _Noisy(model.lm_head)
    (plain,) = measure(model, PROMPTS, [], None, None, CFG)
    assert plain.repeat.identical < 5 and plain.batched.identical < 5
    assert all(0 <= i < CFG.max_new_tokens for i in plain.repeat.first_difference)


def test_agreement_keeps_the_first_difference():
    a = Agreement()
    a.add([1, 2, 3], [1, 2, 3])
    a.add([1, 2, 3], [1, 9, 3])
    a.add([1, 2], [1, 2, 3])
    assert (a.identical, a.prompts, a.first_difference, str(a)) == (1, 3, [1, 2], "1/3")


def test_batch_invariant_steps_run_the_whole_pool_and_agree_in_bf16():
    """--batch-invariant: every target step runs all the pool's rows (whatever is batched), and in bf16
    a request's tokens alone in the pool equal its tokens batched with others."""
    model = tiny_model(seed=3, dtype=torch.bfloat16)
    drafter = random_drafter(model, 60, seed=1)
    rows_seen: list[int] = []
    step = model.step

    def recording(tokens, *args):
        rows_seen.append(tokens.shape[0])
        return step(tokens, *args)

    model.step = recording
    cfg = ReproConfig(max_new_tokens=12, repeats=2, batch=3, batch_invariant=True)
    plain, spec = measure(model, PROMPTS, [], drafter, SpecConfig(2, 2, 5), cfg)
    assert rows_seen and set(rows_seen) == {3}, sorted(set(rows_seen))
    for agreement in (plain.repeat, plain.batched, spec.repeat, spec.batched):
        assert agreement.identical == agreement.prompts == 5, agreement
    rows_seen.clear()
    measure(model, PROMPTS, [], None, None, ReproConfig(max_new_tokens=4, repeats=1, batch=3))
    assert not rows_seen  # the default engine runs eager batches of the rows present
