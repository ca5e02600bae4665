"""EAGLE-3 decoding on tiny random models (float64): lossless greedy, self-draft, trees."""


import pytest
import torch

from specdecode.core.drafter import random_drafter
from specdecode.core.profiler import PhaseClock
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import (
    SpecConfig,
    SpecRow,
    ancestor_mask,
    draft_rows,
    prefill,
    spec_cycle,
    start_draft,
)
from tests.core.helpers import baseline, tokens
from tests.helpers import eagle3_steps, perturbed, tiny_model

CONFIGS = [SpecConfig(1, 1), SpecConfig(3, 1), SpecConfig(5, 1), SpecConfig(2, 2, 4), SpecConfig(3, 3, 8),
           SpecConfig(4, 2, 10), SpecConfig(3, 4, 20)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_greedy_random_drafter_equals_baseline(config, seed):
    target = tiny_model(seed=seed)
    drafter = random_drafter(target, draft_vocab_size=61, seed=seed, init_std=0.3)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (1 + 7 * seed,), generator=gen).tolist()
    out = tokens(eagle3_steps(target, drafter, prompt, 40, SamplingParams(), None, config))
    assert out[:40] == baseline(target, prompt, 40)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_partial_acceptance_equals_baseline(config, seed):
    target = tiny_model(seed=10 + seed)
    prompt = list(range(3, 3 + 5 + 4 * seed))
    drafter = SelfDrafter(perturbed(target, 0.05, seed), target, prompt[0])
    steps = list(eagle3_steps(target, drafter, prompt, 48, SamplingParams(), None, config))
    assert tokens(steps)[:48] == baseline(target, prompt, 48)
    accepted = [s.cycle.accepted for s in steps if s.cycle]
    assert max(accepted) >= 1 and min(accepted) < config.max_depth  # both paths exercised


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_self_draft_accepts_everything(config):
    target = tiny_model(seed=20)
    drafter = SelfDrafter(target, target, 5)
    steps = list(eagle3_steps(target, drafter, [5, 6, 7], 40, SamplingParams(), None, config))
    cycles = [s.cycle for s in steps if s.cycle]
    if config.topk == 1:  # a chain of the target's own greedy tokens is accepted whole
        assert all(c.accepted == config.max_depth for c in cycles[:-1])
    else:  # the best depth-1 node (the greedy token) is always in the tree and accepted;
        # deeper greedy nodes may lose the reranking to siblings, as in EAGLE-2
        assert all(c.accepted >= 1 for c in cycles[:-1])
    assert tokens(steps)[:40] == baseline(target, [5, 6, 7], 40)


def test_tree_shape_and_mask():
    mask = ancestor_mask([-1, 0, 0, 1, 2, 2])
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]


@pytest.mark.parametrize("kwargs", [{"num_steps": 0}, {"topk": 0}, {"num_steps": 2, "topk": 1, "num_draft_tokens": 4},
                                    {"num_steps": 2, "topk": 2, "num_draft_tokens": 1}])
def test_bad_spec_config(kwargs):
    with pytest.raises(ValueError):
        SpecConfig(**kwargs)


def test_spec_config_defaults():
    assert SpecConfig(4, 1).num_draft_tokens == 5
    assert SpecConfig(3, 4).num_draft_tokens == 13
    assert SpecConfig(5, 4, 16).max_depth == 5


@pytest.mark.parametrize("config", [SpecConfig(3, 1), SpecConfig(3, 3, 8), SpecConfig(4, 2, 10)], ids=str)
@pytest.mark.parametrize("kind", ["eagle3", "self"])
def test_every_rows_tree_drafted_together_equals_each_drafted_alone(config, kind):
    """draft_rows over a batch of rows of different lengths (one draft forward per level for all
    of them) gives each row the tree it gets as a batch of one, and the cycle the same tokens."""
    target = tiny_model(seed=3)
    drafter = (random_drafter(target, draft_vocab_size=61, seed=3, init_std=0.3) if kind == "eagle3"
               else SelfDrafter(perturbed(target, 0.05, 3), target, 0))
    prompts = [[5, 6, 7], list(range(10, 30)), [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    aux = drafter.config.aux_layer_ids

    def started(tpool, dpool, i, prompt):
        row = SpecRow()
        logits = prefill(target, tpool.rows(i, i + 1), row, prompt, len(prompt), aux)
        start_draft(drafter, dpool.rows(i, i + 1), row, int(logits.argmax()))
        return row

    def caches(n):
        return target.new_cache(n, 128), drafter.new_cache(160, n)

    tpool, dpool = caches(3)
    rows = [started(tpool, dpool, i, p) for i, p in enumerate(prompts)]
    alone = []
    for p in prompts:
        tcache, dcache = caches(1)
        alone.append((tcache, dcache, started(tcache, dcache, 0, p)))
    for _ in range(4):  # a few cycles: rows drift to different lengths
        trees = draft_rows(drafter, dpool.rows(0, 3), rows, config)
        for tree, (_, dcache, row) in zip(trees, alone, strict=True):
            own = draft_rows(drafter, dcache, [row], config)[0]
            assert tree.tokens.tolist() == own.tokens.tolist() and tree.parents == own.parents
        together = spec_cycle(target, drafter, tpool.rows(0, 3), dpool.rows(0, 3), rows, config, PhaseClock("cpu"))
        for b, (tcache, dcache, row) in enumerate(alone):
            one = spec_cycle(target, drafter, tcache, dcache, [row], config, PhaseClock("cpu"))
            assert together.tokens[b] == one.tokens[0]
            assert together.records[b].accepted == one.records[0].accepted
    assert len(set(tpool.lengths)) > 1 or kind == "self"


@pytest.mark.parametrize("config", [SpecConfig(1, 1), SpecConfig(3, 1), SpecConfig(3, 1, 3)], ids=str)
def test_a_chain_is_each_levels_argmax_with_its_probability(config):
    """A chain (top-1) skips the tree ranking: its nodes are the draft's argmax at each level, in order (the
    first num_draft_tokens - 1 of them), each the child of the one before, with the draft's probability of
    it as its confidence; drafted one level at a time by hand, the same."""
    target = tiny_model(seed=3)
    drafter = random_drafter(target, draft_vocab_size=61, seed=3, init_std=0.3)
    row = SpecRow()
    prompt = list(range(10, 22))
    dcache = drafter.new_cache(64)
    logits = prefill(target, target.new_cache(1, 64), row, prompt, len(prompt), drafter.config.aux_layer_ids)
    start_draft(drafter, dcache, row, int(logits.argmax()))
    tree = draft_rows(drafter, dcache, [row], config)[0]
    m = config.num_draft_tokens - 1
    assert tree.parents == list(range(-1, m)) and tree.depths.tolist() == list(range(m + 1))
    assert torch.equal(tree.mask, ancestor_mask(tree.parents))
    # by hand: the argmax of each level, fed its own output hidden state
    expected, conf = [], []
    state_logits, hidden = row.state.logits, row.state.hidden
    for depth in range(m):
        p = torch.softmax(state_logits.double(), -1)
        best = int(p.argmax())
        expected.append(int(drafter.to_target_ids(torch.tensor(best))))
        conf.append(float(p[best]))
        if depth + 1 < m:
            n = dcache.length
            step_logits, step_hidden = drafter(torch.tensor([[expected[-1]]]), hidden.view(1, 1, -1),
                                               torch.tensor([row.dpairs - 1 + depth + 1]), dcache)
            state_logits, hidden = step_logits[0, -1], step_hidden[0, -1]
            assert dcache.length == n + 1
    assert tree.tokens.tolist() == [row.root, *expected]
    assert tree.confidence == pytest.approx((1.0, *conf))
