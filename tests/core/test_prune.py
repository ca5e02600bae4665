"""Each cycle's verify size from the proposers' confidence (``core.prune``): the size it picks against the
costs, what it learns, the subtree it keeps, and losslessness (float64 greedy == plain; the target's
distribution when sampling, chi-square)."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.core.drafter import random_drafter
from specdecode.core.engine import Engine
from specdecode.core.prune import NGRAM_PRIOR, VerifyBudget
from specdecode.core.requests import GenerateOptions, TokenIdsOnly
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Acceptance, DraftTree, Eagle3Decoder, SpecConfig, ancestor_mask, graft, select
from tests.core.helpers import sampled_joint_matches_the_target
from tests.helpers import perturbed, plain_steps, tiny_model


def chain(confidence):
    n = len(confidence) + 1
    parents = [-1, *range(n - 1)]
    return DraftTree(torch.arange(10, 10 + n), parents, torch.arange(n), ancestor_mask(parents),
                     confidence=(1.0, *confidence))


def test_the_size_with_the_most_tokens_per_millisecond_is_verified():
    tree = chain([0.9, 0.9, 0.05])
    free = VerifyBudget(lambda t: 1.0, rest_ms=1.0, explore_every=10**9)  # more nodes cost nothing: all of them
    assert free.prune([tree])[0].size == 4
    dear = VerifyBudget(lambda t: 10.0 * t, rest_ms=0.0, explore_every=2)  # each node costs a step: the root alone
    assert dear.prune([tree])[0].size == 1
    assert dear.prune([tree])[0].size == 4  # ... but every second cycle here verifies all, to keep learning
    steps = VerifyBudget(lambda t: 1.0 + 0.2 * t, rest_ms=1.0)  # the unlikely third node does not pay
    kept = steps.prune([tree])[0]
    assert kept.size == 3 and kept.tokens.tolist() == [10, 11, 12] and kept.confidence == (1.0, 0.9, 0.9)
    assert steps.sizes == {3: 1}


def test_a_batch_verifies_one_size_and_each_row_keeps_its_likeliest_nodes():
    sure, unsure = chain([0.95, 0.95, 0.95]), chain([0.05, 0.05, 0.05])
    budget = VerifyBudget(lambda t: 1.0 + 0.25 * t, rest_ms=1.0)
    a, b = budget.prune([sure, unsure])
    assert a.size == b.size == 4 and b.padding == 0  # the sure row decides; the other's nodes come free
    alone = budget.prune([unsure])[0]
    assert alone.size < 4


def test_calibration_learns_what_the_head_gets_accepted():
    budget = VerifyBudget(lambda t: 1.0, rest_ms=1.0)
    tree = chain([0.9, 0.9])
    before = budget.chance(tree, 1)
    for _ in range(50):  # the head says 0.9, but its nodes are never accepted
        budget.observe([tree], [Acceptance([0], 5)])
    assert budget.chance(tree, 1) < 0.1 < before
    assert budget.draft.reached[9] == 50  # node 2 was never reached (its parent was not accepted)
    ngram = graft(tree, [99, 98], match=3)  # a branch only the n-gram proposed
    assert budget.chance(ngram, 3) == pytest.approx(NGRAM_PRIOR)
    budget.observe([ngram], [Acceptance([0, 3, 4], 7)])
    assert budget.chance(ngram, 3) > NGRAM_PRIOR


def test_select_keeps_a_subtree_in_order_and_pads():
    parents = [-1, 0, 0, 1, 2]
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), parents, torch.tensor([0, 1, 1, 2, 2]), ancestor_mask(parents),
                     frozenset({4}), 0, (1.0, 0.5, 0.4, 0.3, 0.0), {2: (3, 1), 4: (3, 2)})
    kept = select(tree, [2, 4], size=4)
    assert kept.tokens.tolist() == [5, 7, 9, 5] and kept.parents == [-1, 0, 1, -1] and kept.padding == 1
    assert kept.ngram_nodes == {2} and kept.ngram_at == {1: (3, 1), 2: (3, 2)} and kept.drafted == 2
    assert torch.equal(kept.mask, ancestor_mask(kept.parents))
    with pytest.raises(ValueError, match="parent must be kept"):
        select(tree, [3])


V = 16


def test_greedy_with_pruning_equals_plain():
    """float64, random and partly right heads, with and without n-gram proposals, costs that prune hard and
    costs that keep most: the output is plain decoding's, and the sizes verified vary."""
    sizes = set()
    for seed in range(3):
        target = tiny_model(seed=seed, vocab_size=V)
        rng = random.Random(seed)
        prompt = [rng.randrange(V) for _ in range(12)]
        plain = [t for s in plain_steps(target, prompt, 40, SamplingParams()) for t in s.tokens][:40]
        heads = (random_drafter(target, V // 2, seed=seed), SelfDrafter(perturbed(target, 0.05, seed), target, 0))
        for drafter in heads:
            for config in (SpecConfig(3, 1, ngram=3), SpecConfig(2, 2, 5)):
                for slope in (0.05, 0.5):
                    budget = VerifyBudget(lambda t, s=slope: 1.0 + s * t, rest_ms=0.5)
                    decoder = Eagle3Decoder(drafter, config, budget=budget)
                    out = Engine(target, TokenIdsOnly(()), decoder).generate(
                        prompt, GenerateOptions(40, SamplingParams(), stop_token_ids=()))
                    assert out.token_ids == plain, (seed, config, slope)
                    sizes |= set(budget.sizes)
    assert len(sizes) >= 4


@pytest.mark.parametrize("ngram", [0, 3])
def test_sampling_with_pruning_matches_the_target_distribution(ngram):
    budget = VerifyBudget(lambda t: 1.0 + 0.3 * t, rest_ms=0.5)
    finished = sampled_joint_matches_the_target(SpecConfig(3, 2, 6, ngram=ngram), budget)
    assert sum(f.profile.accepted for f in finished.values()) > 500 and len(budget.sizes) > 1  # speculation mattered
