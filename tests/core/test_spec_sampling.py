"""Speculative sampling must reproduce the target distribution exactly (chi-square tests)."""

import itertools

import pytest
import torch

from specdecode.core.sampling import SamplingParams, logits_to_probs
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import DraftTree, Verification, accept_sampling, ancestor_mask
from tests.core.helpers import chi_square_p
from tests.helpers import eagle3_steps, perturbed, tiny_model


def test_chi_square_helper_detects_a_wrong_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    draws = torch.multinomial(p, 5000, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=3).double()
    assert chi_square_p(counts, p.double()) > 1e-3
    assert chi_square_p(counts, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)) < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=str)
def test_tree_acceptance_preserves_target_distribution(params):
    """Fixed tree and fixed target logits: the first emitted token follows p(root) and the
    second, after a given accepted child, follows p(child)."""
    V = 8
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen, dtype=torch.float64) * 1.5
    parents = [-1, 0, 0, 0, 1, 1]
    tokens = torch.tensor([7, 2, 5, 0, 3, 6])  # children of root: 2, 5, 0; children of node 1: 3, 6
    tree = DraftTree(tokens, parents, torch.tensor([0, 1, 1, 1, 2, 2]), ancestor_mask(parents))
    ver = Verification(logits, torch.zeros(6, 1))
    p_root = logits_to_probs(logits[0], params)
    child = max((1, 2, 3), key=lambda c: float(p_root[tokens[c]]))  # a likely child to condition on
    n = 40000
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        acc = accept_sampling(tree, ver, params, gen)
        out = acc.new_tokens(tree)
        first[out[0]] += 1
        if out[0] == tokens[child]:
            second[out[1]] += 1
    assert second.sum() > 500
    assert chi_square_p(first, p_root) > 1e-3
    assert chi_square_p(second, logits_to_probs(logits[child], params)) > 1e-3


def test_end_to_end_spec_sampling_matches_target():
    """Joint distribution of the first three generated tokens of a tiny model, sampled
    with EAGLE-style tree speculation and a partly-right drafter, against the exact one."""
    V = 6
    target = tiny_model(seed=30, vocab_size=V, num_layers=3)
    drafter = SelfDrafter(perturbed(target, 0.1, 0), target, 1)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0)
    from specdecode.core.speculative import SpecConfig

    # exact joint by enumeration
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    cache_len = 16
    for a, b in itertools.product(range(V), repeat=2):
        seq = prompt + [a, b]
        lg = target(torch.tensor([seq]), torch.arange(len(seq)), target.new_cache(1, cache_len)).logits[0]
        p = torch.softmax(lg.double(), -1)
        exact[a, b] = p[len(prompt) - 1, a] * p[len(prompt), b] * p[len(prompt) + 1]
    assert abs(float(exact.sum()) - 1) < 1e-9

    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    accepted = 0
    for _ in range(5000):
        steps = eagle3_steps(target, drafter, prompt, 3, params, gen, SpecConfig(2, 2, 5))
        toks = []
        for s in steps:
            toks += s.tokens
            accepted += s.cycle.accepted if s.cycle else 0
            if len(toks) >= 3:
                break
        counts[tuple(toks[:3])] += 1
    assert accepted > 1000  # the draft is right often enough to matter
    assert chi_square_p(counts.flatten(), exact.flatten()) > 1e-3
