"""Helpers shared by the core tests (tokenizers for token-id models, decoding loops, the chi-square test);
test modules import these, never each other."""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import replace

import torch

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.engine import Engine, baseline_decode
from specdecode.core.requests import GenerateOptions
from specdecode.core.runner import EAGER
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from tests.helpers import perturbed, plain_steps, tiny_model

PROMPTS = [("p0", "cat-a", [5, 17, 3, 42, 8]), ("p1", "cat-b", [1, 2, 3]), ("p2", "cat-a", [60, 61, 9, 9, 9, 30])]


class DigitTokenizer:
    """No stop tokens (every run uses its whole budget); text is the ids."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids):
        return " ".join(map(str, ids))


class Tok:
    eos_token_ids = (3,)

    def decode(self, ids):
        return " ".join(map(str, ids))


def tokens(steps):
    return [t for s in steps for t in s.tokens]


def baseline(model, prompt, n):
    return tokens(plain_steps(model, prompt, n, SamplingParams()))


def run_all(engine, prompts, options, order=None, remove_at=None):
    """Submit as slots free up; returns each request's tokens (and its Finished record)."""
    out = {i: [] for i in range(len(prompts))}
    finished = {}
    queue = list(order if order is not None else range(len(prompts)))
    steps = 0
    while queue or engine.active:
        while queue and engine.free_slots:
            i = queue.pop(0)
            engine.add(i, prompts[i], options[i] if isinstance(options, list) else options)
        report = engine.step()
        steps += 1
        for key, chunk in report.events:
            out[key] += chunk.token_ids
        for done in report.finished:
            finished[done.key] = done
        if remove_at and steps in remove_at:
            finished[remove_at[steps]] = engine.remove(remove_at[steps])
    return out, finished


def generate(model, decoder, prompt, n=24, runner=EAGER):
    """``decoder`` (None: plain decoding) with ``runner``'s steps."""
    engine = Engine(model, Tok(), replace(decoder or baseline_decode, runner=runner))
    return engine.generate(prompt, GenerateOptions(max_new_tokens=n, stop_token_ids=())).token_ids


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Upper-tail p-value of Pearson's chi-square; cells with small expectation are pooled.
    (Wilson-Hilferty normal approximation of the chi-square tail.)"""
    n = observed.sum()
    expected = expected_probs * n
    small = expected < min_expected
    obs = torch.cat((observed[~small], observed[small].sum().view(1)))
    exp = torch.cat((expected[~small], expected[small].sum().view(1)))
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a sample fell where the target has zero probability"
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sampled_joint_matches_the_target(config, budget=None):
    """The joint distribution of the first three tokens, sampled with a partly right head (and whatever
    ``config`` and ``budget`` add) from a prompt that repeats itself, in batches, against the enumerated
    exact joint (chi-square). Returns the requests' Finished records."""
    V6 = 6
    target = tiny_model(seed=30, vocab_size=V6, num_layers=3)
    drafter = SelfDrafter(perturbed(target, 0.1, 0), target, 1)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]
    n0 = len(prompt)
    exact = torch.zeros(V6, V6, V6, dtype=torch.float64)
    for a, b in itertools.product(range(V6), repeat=2):
        seq = prompt + [a, b]
        logits = target(torch.tensor([seq]), torch.arange(len(seq)), target.new_cache(1, 16)).logits[0].double()
        p = torch.softmax(logits, -1)
        exact[a, b] = p[n0 - 1, a] * p[n0, b] * p[n0 + 1]
    n = 3000
    options = [GenerateOptions(3, SamplingParams(temperature=1.0, seed=20_000 + i), stop_token_ids=())
               for i in range(n)]
    engine = BatchEngine(target, Tok(), drafter, config, BatchConfig(slots=8, spec_policy="always"), budget=budget)
    got, finished = run_all(engine, [prompt] * n, options)
    counts = torch.zeros(V6, V6, V6, dtype=torch.float64)
    for toks in got.values():
        counts[tuple(toks)] += 1
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3
    return finished


class RecordingStore:
    """A ``GraphStore`` whose 'build' is the step itself, run eager: which graphs were asked for, at
    no compile cost (what a real store builds is tested in tests/runtime/test_compiling.py)."""

    def __init__(self) -> None:
        self.built: list = []
        self.calls: collections.Counter = collections.Counter()  # key -> calls of its graph
        self.spans: set[int] = set()  # the attention spans its graphs were called with

    def load(self, module, key, step):
        return None

    def build(self, module, key, step, args, dynamic_shapes=None):
        self.built.append(key)

        def graph(*a):
            self.calls[key] += 1
            self.spans.add(a[3].shape[-1])
            return step(*a)
        return graph
