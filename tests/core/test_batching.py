"""Continuous batching (``core.batching``): every request of a batch gets exactly what it would
get alone (greedy tokens in float64, seeded samples, the target's distribution), whatever joins
or leaves around it, with plain, speculative and measured ('auto') steps."""

from __future__ import annotations

import itertools
import random
import time
import types

import pytest
import torch

from specdecode.core import batching
from specdecode.core.batching import (
    BatchConfig,
    BatchEngine,
    BatchFullError,
    SpecPolicy,
    generate_all,
)
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import Engine
from specdecode.core.requests import ContextLengthError, GenerateOptions
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from tests.core.helpers import Tok, chi_square_p, run_all
from tests.helpers import eagle3_steps, perturbed, plain_steps, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(4, 97) for _ in range(rng.randrange(2, 40))] for _ in range(7)]


def drafters(model):
    return {"eagle3": random_drafter(model, 50, seed=1),
            "self": SelfDrafter(perturbed(model, 0.05, 1), model, first_token=0)}


@pytest.mark.parametrize("policy", ["never", "always", "auto", "adaptive"])
@pytest.mark.parametrize("kind", ["eagle3", "self"])
def test_greedy_batch_equals_each_request_alone(model, prompts, policy, kind):
    drafter = drafters(model)[kind]
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    options = GenerateOptions(max_new_tokens=24)  # stop token 3 ends some early
    alone = [Engine(model, Tok(), Eagle3Decoder(drafter, spec)).generate(p, options).token_ids for p in prompts]
    # 3 slots for 7 requests (they join as others leave), prompts prefilled 5 tokens per step
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=3, prefill_chunk=5, spec_policy=policy))
    engine.calibrate(prompts[1])  # 'auto' only; its rows leave the pool as they came
    got, finished = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == alone
    assert all(finished[i].finish_reason in ("stop", "length") for i in range(len(prompts)))
    assert engine.active == 0 and engine.free_slots == 3


def test_self_draft_with_the_target_accepts_everything_in_a_batch(model, prompts):
    """The drafter's cache rows stay in step with each request: with the target proposing its own
    tokens every proposal is accepted, in every row."""
    spec = SpecConfig(num_steps=3, topk=1)
    prompts = [[7, *p] for p in prompts]  # the self-drafter is told the first token
    engine = BatchEngine(model, Tok(), SelfDrafter(model, model, first_token=7), spec,
                         BatchConfig(slots=4, prefill_chunk=8, spec_policy="always"))
    got, finished = run_all(engine, prompts, GenerateOptions(max_new_tokens=30, stop_token_ids=()))
    for done in finished.values():
        p = done.profile
        assert p.cycles and p.accepted == p.drafted == 3 * p.cycles
    assert all(len(got[i]) == 30 for i in got)


def test_eagle3_acceptance_per_request_equals_alone(model, prompts):
    """Batched drafter extends (padded rows) give each request the draft it gets alone."""
    drafter = SelfDrafter(perturbed(model, 0.02, 4), model, first_token=0)
    eagle = random_drafter(model, 97, seed=2)
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5)
    options = GenerateOptions(max_new_tokens=20, stop_token_ids=())
    for d in (drafter, eagle):
        alone = []
        for p in prompts:
            steps = list(eagle3_steps(model, d, p, 20, SamplingParams(), None, spec))
            alone.append([s.cycle.accepted for s in steps if s.cycle])
        engine = BatchEngine(model, Tok(), d, spec, BatchConfig(slots=4, spec_policy="always"))
        _, finished = run_all(engine, prompts, options)
        for i, per_cycle in enumerate(alone):
            hist = finished[i].profile.depth_hist
            assert sorted(hist.elements()) == sorted(per_cycle), i


def test_a_request_leaving_mid_batch_changes_no_other(model, prompts):
    spec = SpecConfig(num_steps=2, topk=1)
    drafter = random_drafter(model, 60, seed=5)
    options = GenerateOptions(max_new_tokens=16, stop_token_ids=())
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=4, prefill_chunk=6, spec_policy="always"))
    alone, _ = run_all(engine, prompts, options)
    # request 1 leaves while decoding, request 5 while waiting for its prefill
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=4, prefill_chunk=6, spec_policy="always"))
    got, finished = run_all(engine, prompts, options, remove_at={3: 1, 9: 5})
    assert finished[1].finish_reason == "cancelled" and finished[5] is not None
    assert len(got[1]) < 16
    for i in set(range(len(prompts))) - {1, 5}:
        assert got[i] == alone[i], i


@pytest.mark.parametrize("policy", ["never", "always", "auto", "adaptive"])
def test_seeded_sampling_in_a_batch_equals_alone(model, prompts, policy):
    """One draw per emitted token, in order: a seeded request gives the same tokens batched or
    alone, speculating or not."""
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    drafter = SelfDrafter(perturbed(model, 0.05, 1), model, first_token=0)
    options = [GenerateOptions(max_new_tokens=20, sampling=SamplingParams(0.8, 0, 0.95, seed), stop_token_ids=())
               for seed in range(len(prompts))]
    plain = [Engine(model, Tok()).generate(p, o).token_ids for p, o in zip(prompts, options, strict=True)]
    spec_alone = [Engine(model, Tok(), Eagle3Decoder(drafter, spec)).generate(p, o).token_ids
                  for p, o in zip(prompts, options, strict=True)]
    assert spec_alone == plain
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=3, spec_policy=policy))
    got, _ = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == plain


def test_batched_spec_sampling_matches_the_target_distribution():
    """The joint distribution of the first three tokens over many requests sampled together in
    speculative batches (chi-square against the enumerated exact joint)."""
    V = 6
    target = tiny_model(seed=30, vocab_size=V, num_layers=3)
    drafter = SelfDrafter(perturbed(target, 0.1, 0), target, 1)
    prompt = [1, 2, 3]
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b in itertools.product(range(V), repeat=2):
        seq = prompt + [a, b]
        p = torch.softmax(target(torch.tensor([seq]), torch.arange(5), target.new_cache(1, 8)).logits[0].double(), -1)
        exact[a, b] = p[2, a] * p[3, b] * p[4]
    n = 3000
    options = [GenerateOptions(3, SamplingParams(temperature=1.0, seed=10_000 + i), stop_token_ids=())
               for i in range(n)]
    engine = BatchEngine(target, Tok(), drafter, SpecConfig(2, 2, 5), BatchConfig(slots=8, spec_policy="always"))
    got, finished = run_all(engine, [prompt] * n, options)
    assert sum(f.profile.accepted for f in finished.values()) > 1000  # speculation mattered
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for toks in got.values():
        counts[tuple(toks)] += 1
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3


def test_full_batch_and_oversized_requests_are_refused(model):
    engine = BatchEngine(model, Tok(), None, None, BatchConfig(slots=1, slot_tokens=20))
    engine.add("a", [5, 6], GenerateOptions(4))
    with pytest.raises(BatchFullError, match="all 1 batch slots"):
        engine.add("b", [5, 6], GenerateOptions(4))
    with pytest.raises(ContextLengthError, match="exceeds the 20 tokens of a batch slot"):
        engine.check(15, GenerateOptions(6))
    assert engine.remove("a") is not None and engine.remove("a") is None
    with pytest.raises(ValueError, match="spec_policy must be one of always, never, auto"):
        BatchConfig(spec_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slots must be >= 1"):
        BatchConfig(slots=0)
    with pytest.raises(ValueError, match=r"exceed the model's context of 256 tokens; use at most 256"):
        BatchEngine(model, Tok(), None, None, BatchConfig(slot_tokens=1000))


def test_adaptive_policy_keeps_the_faster_mode_and_keeps_measuring():
    policy = SpecPolicy("adaptive", can_speculate=True, warmup=2, explore_every=4)
    assert policy.choose(4) is True  # each mode is measured first
    for _ in range(2):
        policy.record(4, True, 12, 0.1)  # 120 tok/s speculating
    assert policy.choose(4) is False
    for _ in range(2):
        policy.record(4, False, 4, 0.05)  # 80 tok/s plain
    picks = [policy.choose(4) for _ in range(8)]
    assert picks.count(True) == 6 and picks.count(False) == 2  # every 4th step re-tries the other
    assert policy.choose(2) is True  # an unseen batch size is measured first
    assert policy.accept_length == pytest.approx(3.0) and policy.rate(4, True) == pytest.approx(120)
    assert SpecPolicy("adaptive", can_speculate=False).choose(4) is False
    assert SpecPolicy("always", can_speculate=True).choose(1) is True


def test_generate_all_matches_single_requests():
    """Offline generation (``data build``) through the batch: each prompt's tokens end at its
    first stop token (included) or its budget, as decoded alone; more prompts than slots."""
    model = tiny_model(seed=8)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14], [20, 21]]
    stop = [5]
    budgets = [15, 9, 15, 4, 12]
    done = {}
    got = generate_all(model, prompts, [GenerateOptions(b) for b in budgets], stop,
                       BatchConfig(slots=2, spec_policy="never"), on_done=lambda i, ids: done.setdefault(i, ids))
    for p, b, g in zip(prompts, budgets, got, strict=True):
        ref = []
        for step in plain_steps(model, p, b, SamplingParams()):
            ref += step.tokens
            if ref[-1] in stop:
                break
        assert g == ref
    assert done == dict(enumerate(got))


def test_a_request_alone_is_a_batch_of_one_sized_for_it(model):
    """``Engine`` runs the batch engine over one row whose slot holds exactly the request: prompt, new
    tokens and the largest tree a verify writes past them; too long a request names the model's context."""
    drafter = SelfDrafter(model, model, first_token=0)
    options = GenerateOptions(max_new_tokens=10)
    batch = Engine(model, Tok(), Eagle3Decoder(drafter, SpecConfig(2, 2, 4))).batch_for(7, options)
    assert (batch.config.slots, batch.limit, batch.margin, batch.policy.name) == (1, 7 + 10 + 4, 4, "always")
    plain = Engine(model, Tok()).batch_for(7, options)
    assert (plain.limit, plain.margin, plain.policy.name, plain.drafter) == (17, 0, "never", None)
    context = model.config.max_position_embeddings
    with pytest.raises(ContextLengthError, match=f"exceeds the model context of {context} tokens"):
        Engine(model, Tok()).batch_for(context, options)


@pytest.mark.parametrize("slow", ["plain", "verify"])
def test_auto_is_timed_once_per_batch_size_then_the_same_for_every_request(model, prompts, slow, monkeypatch):
    """'auto' times both modes per batch size bucket before any request and keeps the faster, so a
    repeated request runs the same steps every time (in bf16 the two modes round differently: issue
    26); the calibration rows leave nothing behind."""
    drafter = SelfDrafter(perturbed(model, 0.05, 1), model, first_token=0)
    engine = BatchEngine(model, Tok(), drafter, SpecConfig(num_steps=2, topk=1), BatchConfig(slots=3))
    assert engine.policy.name == "auto"  # the default
    # one mode made clearly slower on a virtual clock the engine reads: every target call costs 10 ms, its calls
    # of one token (plain steps) or of several (verify) 60 ms more. Real sleeps flipped a batch size's choice
    # whenever another job shared the 2 cores (seen with 20 ms and with 60 ms sleeps)
    now = [0.0]
    monkeypatch.setattr(batching, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def cost(m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        now[0] += 0.01 + (0.06 if (args[0].shape[1] == 1) == (slow == "plain") else 0.0)

    hook = model.register_forward_pre_hook(cost)
    try:
        chosen = engine.calibrate(prompts[0])
    finally:
        hook.remove()
    monkeypatch.undo()
    assert now[0] > 0  # the engine timed the steps on the virtual clock
    assert chosen == {1: slow == "plain", 2: slow == "plain", 3: slow == "plain"}
    assert engine.active == 0 and engine.free_slots == 3
    options = GenerateOptions(max_new_tokens=12, stop_token_ids=())
    runs = []
    for _ in range(3):  # the same request again and again, alone
        engine.add("r", prompts[2], options)
        modes, tokens = [], []
        while engine.active:
            report = engine.step()
            modes += [report.speculative] if report.batch else []
            tokens += [t for _, c in report.events for t in c.token_ids]
        runs.append((modes, tokens))
    assert runs[0] == runs[1] == runs[2] and set(runs[0][0]) == {slow == "plain"}
    assert SpecPolicy("auto", can_speculate=True).choose(4) is True  # not calibrated: speculative


def test_a_short_prompt_behind_a_long_one_starts_after_one_chunk(model):
    """Prefill chunks go round the waiting requests: a 3-token prompt queued behind a 60-token one gets
    its first token on the second step, not after the long prompt's 15 chunks; both decode as alone."""
    long, short = list(range(4, 64)), [5, 6, 7]
    options = GenerateOptions(max_new_tokens=4, stop_token_ids=())
    engine = BatchEngine(model, Tok(), config=BatchConfig(slots=2, prefill_chunk=4, spec_policy="never"))
    engine.add("long", long, options)
    engine.add("short", short, options)
    first: dict[str, int] = {}
    out: dict[str, list[int]] = {"long": [], "short": []}
    step = 0
    while engine.active:
        step += 1
        for key, chunk in engine.step().events:
            first.setdefault(key, step)
            out[key] += chunk.token_ids
    assert first["short"] == 2 and first["long"] == 16
    for key, prompt in (("long", long), ("short", short)):
        assert out[key] == Engine(model, Tok()).generate(prompt, options).token_ids


def test_slots_too_short_for_auto_calibration_are_refused_up_front():
    """serve --context-length 32 had crashed the start-up timing behind a healthy /health: the engine now
    says how many tokens a request needs for it (or to choose the mode) before anything runs."""
    model = tiny_model(seed=1, max_position_embeddings=256)
    drafter = random_drafter(model, 50, seed=1)
    short = BatchEngine(model, Tok(), drafter, SpecConfig(2, 1), BatchConfig(slots=2, slot_tokens=40))
    with pytest.raises(ValueError, match=r"allow at least \d+ tokens per request .*--spec-policy never or always"):
        short.check_calibration(30)
    with pytest.raises(ValueError, match="leave no room for spec policy auto"):
        short.calibrate(list(range(4, 34)))
    BatchEngine(model, Tok(), drafter, SpecConfig(2, 1), BatchConfig(slots=2, slot_tokens=40,
                                                                      spec_policy="never")).check_calibration(30)
    roomy = BatchEngine(model, Tok(), drafter, SpecConfig(2, 1), BatchConfig(slots=2, slot_tokens=200))
    roomy.check_calibration(30)
    assert set(roomy.calibrate(list(range(4, 34)))) == {1, 2}


def test_a_cpu_burst_during_calibration_is_timed_again_not_kept():
    """A burst of load during 'auto''s start-up timing had left rates of 1-6 tok/s for the server's
    life: a disturbed round (median step far above the fastest) is timed again, and each mode is
    judged by its fastest steps."""
    model = tiny_model(seed=1, max_position_embeddings=512)
    drafter = random_drafter(model, 50, seed=1)
    engine = BatchEngine(model, Tok(), drafter, SpecConfig(2, 1), BatchConfig(slots=1, slot_tokens=400))
    calls = {"n": 0}
    burst = range(3, 11)  # 8 of the first round's 12 timed steps (after the 2 untimed ones)

    def disturbed(step):
        def run(report):
            calls["n"] += 1
            if calls["n"] in burst:
                time.sleep(0.1)  # another process took the CPU
            return step(report)
        return run

    engine._plain_step = disturbed(engine._plain_step)
    engine._spec_step = disturbed(engine._spec_step)
    engine.calibrate(list(range(4, 20)))
    assert calls["n"] >= 2 + 2 * 2 * batching.CALIBRATION_STEPS  # a second round ran
    spec_rate, plain_rate = engine.policy.calibrated_rates[1]
    assert plain_rate > 30 and spec_rate > 30, engine.policy.calibrated_rates  # not 1 token per 0.1 s
