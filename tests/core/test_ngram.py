"""N-gram proposals from the request's own text (``core.ngram``) beside the drafter's tree: the
index, the graft into a tree, and losslessness (float64 greedy == plain, alone and batched; the
target's distribution when sampling, chi-square)."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.drafter import random_drafter
from specdecode.core.ngram import NgramIndex
from specdecode.core.requests import GenerateOptions
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import DraftTree, SpecConfig, ancestor_mask, graft
from tests.core.helpers import Tok, run_all, sampled_joint_matches_the_target
from tests.helpers import eagle3_steps, perturbed, plain_steps, tiny_model


def index(tokens, **kw):
    ix = NgramIndex(**kw)
    ix.extend(tokens)
    return ix


def test_the_longest_latest_match_is_proposed():
    # "5 6" occurs twice before the end: the latest occurrence wins
    assert index([5, 6, 1, 2, 5, 6, 3, 4, 9, 5, 6]).propose(2) == [3, 4]
    # "7 5 6" (3 tokens) beats the later "5 6" (2 tokens)
    assert index([7, 5, 6, 1, 1, 5, 6, 2, 2, 7, 5, 6]).propose(2) == [1, 1]
    # a single token is no match (min_n = 2), nor a suffix seen only at the end
    assert index([1, 2, 3, 4, 3]).propose(3) == []
    assert index([1, 2, 3]).propose(3) == []
    assert index([1, 2, 3, 4, 3], min_n=1).propose(2) == [4, 3]
    # a copy that reaches the end goes on with its own period
    assert index([1, 2, 3, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]
    ix = index([1, 2])
    ix.extend([3, 1, 2])  # incremental = at once
    assert ix.propose(4) == index([1, 2, 3, 1, 2]).propose(4) == [3, 1, 2, 3]
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(min_n=3, max_n=2)


def tree(tokens, parents):
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = depths[p] + 1 if p >= 0 else 0
    return DraftTree(torch.tensor(tokens), parents, torch.tensor(depths), ancestor_mask(parents))


def test_graft_follows_the_tree_where_it_agrees_and_branches_where_it_parts():
    t = tree([9, 4, 5, 6], [-1, 0, 0, 1])  # root 9; children 4, 5; 4 -> 6
    g = graft(t, [4, 6, 7, 8])  # along 4 -> 6, then two new nodes
    assert g.tokens.tolist() == [9, 4, 5, 6, 7, 8] and g.parents == [-1, 0, 0, 1, 3, 4]
    assert g.depths.tolist() == [0, 1, 1, 2, 3, 4] and g.ngram_nodes == {4, 5} and g.drafted == 5
    assert torch.equal(g.mask, ancestor_mask(g.parents))
    b = graft(t, [5, 2])  # follows 5, then branches under it
    assert b.parents == [-1, 0, 0, 1, 2] and b.ngram_nodes == {4}
    c = graft(t, [3], size=7)  # a new branch at the root, then padding nobody reaches
    assert c.parents == [-1, 0, 0, 1, 0, -1, -1] and c.padding == 2 and c.drafted == 4
    assert c.mask[5].tolist() == [False] * 5 + [True, False]  # padding sees only itself
    assert [i for kids in c.children() for i in kids] == [1, 2, 4, 3]  # padding is no one's child
    again = graft(c, [3, 1], size=7)  # a padded tree: its padding is replaced, not kept
    assert again.parents == [-1, 0, 0, 1, 0, 4, -1] and again.ngram_nodes == {4, 5}


V = 16  # a small vocabulary: tiny random models' greedy text then repeats itself, as copying text does


def repetitive_prompt(seed):
    rng = random.Random(seed)
    phrase = [rng.randrange(0, V) for _ in range(rng.randrange(3, 8))]
    return [rng.randrange(0, V) for _ in range(3)] + phrase * 3 + phrase[:2]


def tokens(steps):
    return [t for s in steps for t in s.tokens]


CONFIGS = [SpecConfig(1, 1, ngram=3), SpecConfig(3, 1, ngram=4), SpecConfig(2, 2, 4, ngram=5),
           SpecConfig(3, 3, 8, ngram=2)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label)
def test_greedy_with_ngram_proposals_equals_plain(config):
    """float64: a random head (rarely right) and a partly right one, on prompts that repeat a
    phrase; the n-gram's own tokens are accepted, and the output is plain decoding's."""
    from_ngram = 0
    for seed in range(4):
        target = tiny_model(seed=seed, vocab_size=V)
        prompt = repetitive_prompt(seed)
        plain = tokens(plain_steps(target, prompt, 40, SamplingParams()))
        for drafter in (random_drafter(target, draft_vocab_size=V // 2, seed=seed, init_std=0.3),
                        SelfDrafter(perturbed(target, 0.05, seed), target, prompt[0])):
            steps = list(eagle3_steps(target, drafter, prompt, 40, SamplingParams(), None, config))
            assert tokens(steps)[:40] == plain
            cycles = [s.cycle for s in steps if s.cycle]
            assert all(c.drafted <= config.max_tree - 1 for c in cycles)
            from_ngram += sum(c.ngram_accepted for c in cycles)
    assert from_ngram > 0


def test_a_batch_with_ngram_proposals_equals_each_request_alone():
    """Rows with and without a match verify together (padded trees); each gets its greedy tokens."""
    model = tiny_model(seed=3, vocab_size=V)
    drafter = random_drafter(model, V // 2, seed=1)
    rng = random.Random(1)
    prompts = [repetitive_prompt(i) if i % 2 else [rng.randrange(0, V) for _ in range(rng.randrange(2, 30))]
               for i in range(7)]
    options = GenerateOptions(24, SamplingParams(), stop_token_ids=())
    alone = [tokens(plain_steps(model, p, 24, SamplingParams()))[:24] for p in prompts]
    engine = BatchEngine(model, Tok(), drafter, SpecConfig(1, 1, ngram=4), BatchConfig(slots=3, spec_policy="always"))
    got, finished = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == alone
    assert sum(f.profile.ngram_accepted for f in finished.values()) > 0
    assert any(f.profile.ngram_drafted < f.profile.drafted for f in finished.values())  # both proposers verified


def test_sampling_with_ngram_proposals_matches_the_target_distribution():
    finished = sampled_joint_matches_the_target(SpecConfig(1, 1, ngram=3))
    assert sum(f.profile.ngram_accepted for f in finished.values()) > 100  # the proposals mattered


def test_ngram_shape_sizes_and_refusals():
    c = SpecConfig(1, 1, ngram=6)
    assert (c.max_tree, c.margin, c.max_depth, c.label) == (8, 8, 6, "1/1/2+ngram6")
    with pytest.raises(ValueError, match="ngram"):
        SpecConfig(1, 1, ngram=-1)
