"""The cost model the sweep and --spec-config auto share, the auto request, and the adaptive shape
(which must never change what greedy decoding emits)."""

from dataclasses import replace

import pytest
import torch

from specdecode.core.costmodel import (
    AcceptanceTable,
    AdaptiveShape,
    AutoSpec,
    CycleCosts,
    ShapeCost,
    best_shape,
    candidate_shapes,
    monotone_fit,
    predict,
    shape_key,
)
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import SpecConfig
from tests.core.helpers import baseline, tokens
from tests.helpers import eagle3_steps, perturbed, plain_steps, tiny_model


def costs(verify_per_token=1.0, base=10.0):
    """A verify that costs base + verify_per_token per extra token; a draft step 1 ms per top-k row."""
    return CycleCosts(base, {shape_key(s): ShapeCost(draft_ms=1.0 * (s.num_steps - 1) * s.topk,
                                                     verify_ms=base + verify_per_token * (s.num_draft_tokens - 1),
                                                     other_ms=0.5) for s in candidate_shapes()},
                      {1: 1.0, 3: 2.0})


def test_auto_request_keeps_given_fields():
    assert AutoSpec().static() == SpecConfig()
    assert AutoSpec(num_steps=3).static() == SpecConfig(3, SpecConfig().topk)
    assert AutoSpec(3, 1).complete and not AutoSpec(topk=1).complete
    chains = [s for s in candidate_shapes() if AutoSpec(topk=1).admits(s)]
    assert chains and all(s.topk == 1 for s in chains)
    with pytest.raises(ValueError, match="must be >= 1"):
        AutoSpec(num_steps=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        AutoSpec(2, 1, 9)  # a chain of 2 cannot verify 9 tokens


def test_prediction_is_the_formula():
    table = AcceptanceTable({1: [0.8, 0.5, 0.2, 0.1, 0.0, 0.0]})
    c = costs()
    p = predict(SpecConfig(2, 1), table, c)
    assert p.accept_length == pytest.approx(2.3)
    cycle = 1.0 + (10.0 + 2.0) + 0.5 + c.extend_ms(2.3)  # draft, verify of 3 tokens, other, re-extend
    assert c.extend_ms(2.3) == pytest.approx(1.65)  # interpolated between 1 and 3 tokens
    assert p.cycle_ms == pytest.approx(cycle)
    assert p.speedup == pytest.approx(2.3 * 10.0 / cycle)
    assert predict(SpecConfig(2, 2), table, c) is None  # no acceptance measured for top-2
    # the loop's work around a cycle (text, stop checks) is paid once a cycle, as the plain step pays it a token
    looped = CycleCosts(c.baseline_ms, {k: replace(v, loop_ms=0.4) for k, v in c.shapes.items()},
                        c.extend_ms_by_tokens)
    assert predict(SpecConfig(2, 1), table, looped).cycle_ms == pytest.approx(cycle + 0.4)
    assert CycleCosts.from_dict(looped.to_dict()).shapes == looped.shapes


def test_cheap_verify_favours_depth_and_dear_verify_favours_chains():
    table = AcceptanceTable({1: [0.8, 0.6, 0.45, 0.35, 0.25, 0.2], 2: [0.85, 0.65, 0.5, 0.4, 0.3, 0.25]})
    cheap = best_shape(candidate_shapes(), table, costs(verify_per_token=0.05))[0].shape
    dear = best_shape(candidate_shapes(), table, costs(verify_per_token=4.0))[0].shape
    assert cheap.max_depth > dear.max_depth
    assert dear.num_draft_tokens <= 3


def test_adaptive_shape_follows_the_requests_acceptance():
    table = AcceptanceTable({1: [0.5, 0.25, 0.12, 0.06, 0.03, 0.01]})
    shapes = [s for s in candidate_shapes() if s.topk == 1]
    c = costs(verify_per_token=1.0)
    first = best_shape(shapes, table, c)[0].shape
    easy = AdaptiveShape(shapes, table, c, first)
    shape = first
    for _ in range(32):  # every draft token accepted: a domain the drafter knows well
        shape = easy.record(shape, shape.max_depth)
    assert shape.max_depth > first.max_depth and easy.changes
    hard = AdaptiveShape(shapes, table, c, shape)
    for _ in range(32):  # nothing accepted
        shape = hard.record(shape, 0)
    assert shape.max_depth == 1


class EveryCycle:
    """A shape policy that walks through shapes cycle by cycle (the worst case for caches)."""

    def __init__(self, shapes):
        self.shapes, self.i = shapes, 0

    def record(self, shape, accepted):
        self.i += 1
        return self.shapes[self.i % len(self.shapes)]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_a_changing_shape_equals_baseline(seed):
    target = tiny_model(seed=30 + seed)
    prompt = list(range(3, 9 + 3 * seed))
    drafter = SelfDrafter(perturbed(target, 0.05, seed), target, prompt[0])
    shapes = [SpecConfig(1, 1), SpecConfig(4, 2), SpecConfig(3, 1), SpecConfig(2, 4), SpecConfig(6, 1)]
    steps = list(eagle3_steps(target, drafter, prompt, 60, SamplingParams(), None, shapes[0],
                               policy=EveryCycle(shapes)))
    assert tokens(steps)[:60] == baseline(target, prompt, 60)
    assert len({s.cycle.drafted for s in steps if s.cycle}) > 2  # the shapes did change


def test_sampling_with_a_changing_shape_matches_the_seeded_baseline():
    """One draw per emitted token in the baseline's order: a seeded request is the same whatever the shape."""

    target = tiny_model(seed=40)
    prompt = [3, 4, 5, 6]
    drafter = SelfDrafter(perturbed(target, 0.02, 0), target, prompt[0])
    params = SamplingParams(temperature=0.8, seed=7)
    shapes = [SpecConfig(2, 1), SpecConfig(3, 2), SpecConfig(1, 1)]
    spec = tokens(eagle3_steps(target, drafter, prompt, 40, params, torch.Generator().manual_seed(7), shapes[0],
                                policy=EveryCycle(shapes)))
    base = tokens(plain_steps(target, prompt, 40, params, torch.Generator().manual_seed(7)))
    assert spec[:40] == base


def test_extend_is_priced_as_the_loop_pays_it():
    from specdecode.core.calibrate import in_loop_extend
    from specdecode.core.profiler import CycleRecord

    isolated = {1: 1.0, 2: 1.2, 3: 1.4}
    loop = [CycleRecord(2, a, {"extend": s}) for a, s in [(0, 0.003)] * 4 + [(1, 0.0034)] * 3 + [(2, 0.009)]]
    got = in_loop_extend(isolated, loop)
    assert got[1] == pytest.approx(3.0) and got[2] == pytest.approx(3.4)  # the cycles' own medians
    assert got[3] == pytest.approx(1.4 + 2.1)  # one cycle only: isolated + the median gap (2.0, 2.2)


def test_shapes_measured_at_another_speed_are_put_on_one_time_base():
    """A shape timed while the machine ran at half speed (the plain steps beside it took twice as long) reads at
    half on the common time base: the same prediction as at full speed, and in the pooled fits it pulls no other
    shape's cost (it would, read raw: the chains, measured first, were read against later, faster verifies)."""
    table = AcceptanceTable({1: [0.5, 0.2, 0.1, 0.0, 0.0, 0.0], 2: [0.6, 0.3, 0.1, 0.0, 0.0, 0.0]})
    c = costs()
    slow = CycleCosts(c.baseline_ms, {k: ShapeCost(2 * v.draft_ms, 2 * v.verify_ms, 2 * v.other_ms, 2 * c.baseline_ms)
                                      for k, v in c.shapes.items()}, c.extend_ms_by_tokens)
    for shape in (SpecConfig(1, 1), SpecConfig(4, 1), SpecConfig(2, 2)):
        assert predict(shape, table, slow).speedup == pytest.approx(predict(shape, table, c).speedup)
    mixed, raw = dict(c.shapes), dict(c.shapes)
    for key in ("4/1/5", "2/2/5"):  # two of the three shapes verifying 5 tokens, measured at half speed
        v = c.shapes[key]
        mixed[key] = ShapeCost(2 * v.draft_ms, 2 * v.verify_ms, 2 * v.other_ms, 2 * c.baseline_ms)
        raw[key] = ShapeCost(2 * v.draft_ms, 2 * v.verify_ms, 2 * v.other_ms)  # no plain steps beside: read as is
    assert CycleCosts(c.baseline_ms, mixed, c.extend_ms_by_tokens).verify_ms_by_tokens() == pytest.approx(
        c.verify_ms_by_tokens())
    assert CycleCosts(c.baseline_ms, raw, c.extend_ms_by_tokens).verify_ms_by_tokens()[5] > c.verify_ms_by_tokens()[5]


def test_calibration_alternates_the_order_so_a_drift_reaches_every_shape_alike(monkeypatch):
    """A machine slowing steadily while it calibrates (each timing call 4% slower than the last): the rounds run the
    shapes forwards then backwards, and on the common time base shapes of equal true cost read alike, where one
    round in order read the first shapes cheaper than the last."""
    import specdecode.core.calibrate as cal
    from specdecode.core.profiler import CycleRecord

    calls: list[str] = []

    def speed() -> float:
        return 1.0 + 0.04 * len(calls)

    def plain(target, prompt_ids, steps, warmup=2, runner=None):
        calls.append("plain")
        return [0.010 * speed()] * steps

    def cycles(target, drafter, shape, prompt_ids, n, warmup=1, runner=None):
        calls.append(shape_key(shape))
        times = {"draft": 0.001 * shape.num_steps * speed(), "verify": 0.010 * speed(), "other": 0.0005 * speed(),
                 "extend": 0.001}
        times["total"] = sum(times.values())
        times["wall"] = times["total"] + 0.0003  # the loop's work around the cycle
        return [CycleRecord(shape.num_draft_tokens, 0, dict(times)) for _ in range(n)]

    monkeypatch.setattr(cal, "baseline_step_times", plain)
    monkeypatch.setattr(cal, "shape_cycles", cycles)
    monkeypatch.setattr(cal, "extend_ms", lambda *a, **k: dict.fromkeys(range(1, 8), 1.0))
    shapes = candidate_shapes()
    for rounds, spread in ((1, 0.12), (2, 0.05)):
        calls.clear()
        got = cal.measure_cycle_costs(None, None, shapes, list(range(10)), rounds=rounds)
        order = [c for c in calls if c != "plain"]
        forwards, backwards = [shape_key(s) for s in shapes], [shape_key(s) for s in reversed(shapes)]
        assert order == (forwards if rounds == 1 else forwards + backwards)
        raw = [c.verify_ms for c in got.shapes.values()]  # every verify costs the same on a steady machine
        common = [got.on_common_base(c, c.verify_ms) for c in got.shapes.values()]
        if rounds == 1:
            assert max(raw) / min(raw) > 1.5  # read raw, the first shape is the cheapest
        # the plain steps are timed per group of shapes: the drift inside a group is what is left
        assert max(common) / min(common) < 1 + spread, rounds
        assert all(abs(c.loop_ms - 0.3) < 1e-6 for c in got.shapes.values())  # what the loop pays beside the cycle


def test_costs_are_read_from_monotone_fits_over_every_shape():
    """One shape's few cycles can read far off (here: a chain of 2 verifying its 3 tokens faster than a tree
    verifies 3 and than 2 tokens are verified); the prediction reads the verify by node count pooled over every
    shape and made non-decreasing, and the draft non-decreasing in depth."""
    c = costs(verify_per_token=2.0)  # verify of n tokens: 10 + 2 (n - 1); draft: 1 ms a step after the first
    shapes = dict(c.shapes)
    shapes["2/1/3"] = ShapeCost(draft_ms=1.0, verify_ms=8.0, other_ms=0.5)  # 1/2/3 verifies 3 in 14, 1/1/2 2 in 12
    shapes["4/1/5"] = ShapeCost(draft_ms=9.0, verify_ms=16.0, other_ms=0.5)  # 5/1/6 drafts in 4, 6/1/7 in 5
    noisy = CycleCosts(c.baseline_ms, shapes, c.extend_ms_by_tokens)
    verify = noisy.verify_ms_by_tokens()
    assert list(verify.values()) == sorted(verify.values())
    assert verify[2] == verify[3] == pytest.approx((12 + 8 + 14) / 3) and verify[4] == 16
    drafts = noisy.draft_ms_by_steps()[1]
    assert drafts[3] == 2 and drafts[4] == drafts[5] == drafts[6] == pytest.approx((9 + 4 + 5) / 3)
    assert monotone_fit({1: [1.0, 50.0, 2.0], 2: [4.0]}) == {1: 2.0, 2: 4.0}  # a key's median, not its mean
    assert monotone_fit({1: [1.0], 2: [4.0], 3: [2.0], 4: [0.0]}) == {1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0}
    assert monotone_fit({}) == {} and monotone_fit({3: [5.0, 5.0]}) == {3: 5.0}
    table = AcceptanceTable({1: [0.5, 0.25, 0.12, 0.06, 0.03, 0.01]})
    p = predict(SpecConfig(2, 1), table, noisy)
    assert p.cycle_ms == pytest.approx(1.0 + 34 / 3 + 0.5 + noisy.extend_ms(p.accept_length))
    assert noisy.shape_cost(SpecConfig(4, 1)).draft_ms == pytest.approx(6.0)
