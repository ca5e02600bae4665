"""The prefix cache (``core.prefixcache``) and continuous batching with it: a prompt that starts
like an earlier one copies those positions' keys and values (and the drafter's taps) instead of
computing them, and every request still gets exactly what it gets alone (greedy in float64,
seeded samples); blocks are found only from the start of a prompt, and evicted leaves first."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import Engine
from specdecode.core.kvcache import KVCache
from specdecode.core.prefixcache import PrefixCache
from specdecode.core.requests import GenerateOptions
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from tests.core.helpers import Tok, run_all
from tests.helpers import eagle3_steps, perturbed, tiny_model


def pool(rows=2, slots=65, layers=2):
    """A KV pool whose entries say where they are: layer, row and position."""
    k = [torch.zeros(rows, 1, slots, 2) for _ in range(layers)]
    for layer, t in enumerate(k):
        for r in range(rows):
            t[r, 0, :, 0] = torch.arange(slots) + 1000 * r
            t[r, 0, :, 1] = layer
    return KVCache(k, [t + 0.5 for t in k])


def test_blocks_are_found_from_the_start_and_copied_with_their_taps():
    src = pool()
    cache = PrefixCache(64, src, block=4, taps=3)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    taps = torch.arange(13.0)[:, None].expand(13, 3)
    assert cache.save(prompt, src, row=1, taps=taps) == 3
    assert cache.save(prompt, src, row=1, taps=taps) == 0  # stored once
    # the same prompt: a hit leaves its last token to compute, so 12 of 13 positions (3 blocks)
    assert len(cache.match(prompt)) == 3
    assert len(cache.match(prompt[:12])) == 2  # 12 tokens: 11 may come from the cache, 2 blocks
    # shares the first block only; a block equal to the second but after another first one is not a hit
    assert len(cache.match(prompt[:4] + [0] * 4 + prompt[8:] + [1])) == 1
    assert cache.match([0, 0, 0, 0] + prompt[4:]) == []
    dst = pool()
    got = cache.load(cache.match(prompt + [5]), dst, row=0)
    fresh = pool()
    for t, s, f in zip((*dst.k, *dst.v), (*src.k, *src.v), (*fresh.k, *fresh.v), strict=True):
        assert torch.equal(t[0, :, :12], s[1, :, :12])  # row 1's positions 0..11 now in row 0
        assert torch.equal(t[0, :, 12:], f[0, :, 12:]) and torch.equal(t[1], f[1])  # nothing else written
    assert got is not None and torch.equal(got, taps[:12])
    assert cache.stats.hit_tokens == 12
    with pytest.raises(ValueError, match="holds no taps"):
        PrefixCache(64, src, block=4).save(prompt, src, row=1, taps=taps)


def test_least_recently_used_leaves_go_first_and_a_shared_stem_stays():
    src = pool(slots=33)
    cache = PrefixCache(12, src, block=4)  # 3 blocks
    stem = [1, 2, 3, 4]
    a, b, c = stem + [5, 6, 7, 8], stem + [9, 9, 9, 9], stem + [7, 7, 7, 7]
    cache.save(a, src, 0)
    cache.save(b, src, 0)
    assert cache.used_blocks == 3
    cache.match(a + [0])  # a's leaf used again: b's is now the least recently used leaf
    cache.save(c, src, 0)
    assert len(cache.match(a + [0])) == 2 and len(cache.match(c + [0])) == 2
    assert len(cache.match(b + [0])) == 1  # b's leaf went; the stem they share stayed
    assert cache.stats.evicted_blocks == 1
    # a prompt longer than the whole cache stores what fits, never evicting its own path
    long = list(range(100, 120))
    assert cache.save(long, src, 0) == 3
    assert len(cache.match(long)) == 3


def test_aligned_hits_are_whole_prefill_chunks():
    src = pool()
    cache = PrefixCache(64, src, block=4, aligned=6)  # hits in multiples of lcm(4, 6) = 12 tokens
    prompt = list(range(30))
    cache.save(prompt, src, 0)
    assert len(cache.match(prompt)) == 6  # 29 usable tokens -> 24
    assert len(cache.match(prompt[:20])) == 3  # 19 -> 12
    assert cache.match(prompt[:12]) == []  # 11 -> 0


def test_a_cache_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="holds no block of 16; use at least 16"):
        PrefixCache(8, pool())
    with pytest.raises(ValueError, match="prefix_cache must be 0 .off. or at least one block of 16 tokens"):
        BatchConfig(prefix_cache=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def prompts():
    """A shared 37-token preamble (a system prompt) with different questions after it, two prompts
    asked twice, and one that is a prefix of another."""
    rng = random.Random(1)
    preamble = [rng.randrange(4, 97) for _ in range(37)]
    tails = [[rng.randrange(4, 97) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    out = [preamble + t for t in tails]
    return out + [out[1], out[3], out[2][:45], preamble[:20]]


@pytest.mark.parametrize("kind", ["none", "eagle3", "self"])
@pytest.mark.parametrize("policy", ["never", "always"])
def test_greedy_with_the_prefix_cache_equals_each_request_alone(model, prompts, kind, policy):
    drafter = {"none": None, "eagle3": random_drafter(model, 50, seed=1),
               "self": SelfDrafter(perturbed(model, 0.05, 1), model, first_token=0)}[kind]
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4) if drafter is not None else None
    options = GenerateOptions(max_new_tokens=16, stop_token_ids=())
    alone = [(Engine(model, Tok(), Eagle3Decoder(drafter, spec)) if drafter is not None and spec is not None
              else Engine(model, Tok())).generate(p, options).token_ids for p in prompts]
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=2, prefill_chunk=16, spec_policy=policy))
    got, finished = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == alone
    if drafter is not None and spec is not None and policy == "always":  # the drafter read the cached taps right:
        for i, p in enumerate(prompts):  # it drafts what it drafts alone, cycle by cycle
            steps = eagle3_steps(model, drafter, p, 16, SamplingParams(), None, spec)
            assert sorted(finished[i].profile.depth_hist.elements()) == sorted(s.cycle.accepted for s in steps
                                                                               if s.cycle), i
    assert engine.prefix is not None
    # the preamble's 2 blocks for the 6 prompts that join after the first prefill (the second joins with it)
    assert engine.prefix.stats.hit_tokens >= 6 * 32


def test_seeded_sampling_with_the_prefix_cache_equals_alone(model, prompts):
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    drafter = SelfDrafter(perturbed(model, 0.05, 1), model, first_token=0)
    options = [GenerateOptions(max_new_tokens=12, sampling=SamplingParams(0.8, 0, 0.95, seed), stop_token_ids=())
               for seed in range(len(prompts))]
    plain = [Engine(model, Tok()).generate(p, o).token_ids for p, o in zip(prompts, options, strict=True)]
    engine = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=3, prefill_chunk=16, spec_policy="always"))
    got, _ = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == plain
    assert engine.prefix is not None and engine.prefix.stats.hit_tokens > 0


def test_add_says_how_many_prompt_tokens_were_cached_and_prefill_skips_them(model, prompts):
    options = GenerateOptions(max_new_tokens=2, stop_token_ids=())
    # hits are whole prefill chunks: chunks of one block here
    engine = BatchEngine(model, Tok(), config=BatchConfig(slots=1, prefill_chunk=16, spec_policy="never"))
    assert len(prompts[2]) == 62 and engine.add("a", prompts[2], options) == 0
    assert engine.step().prefill_tokens == 16
    while engine.active:
        engine.step()
    assert engine.add("b", prompts[2], options) == 48  # its 3 full blocks of 16
    assert engine.step().prefill_tokens == 62 - 48
    off = BatchEngine(model, Tok(), config=BatchConfig(slots=1, spec_policy="never", prefix_cache=0))
    assert off.prefix is None and off.add("a", prompts[1], options) == 0


def test_the_drafter_reads_a_cached_prompt_as_a_computed_one(model, prompts):
    """After a prompt's prefill, half of it from the cache, the drafter's cache and prediction at the
    root are those of the same prompt computed whole (the cached taps are the target's own)."""
    drafter = random_drafter(model, 50, seed=1)
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    options = GenerateOptions(max_new_tokens=4, stop_token_ids=())

    def prefilled(engine, prompt):
        engine.add("p", prompt, options)
        while not engine.decoding:
            engine.step()
        return engine.rows[0]

    cached = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=1, prefill_chunk=16, spec_policy="always"))
    run_all(cached, [prompts[0]], options)
    row = prefilled(cached, prompts[2])
    assert row.cached == 32
    fresh = BatchEngine(model, Tok(), drafter, spec, BatchConfig(slots=1, prefill_chunk=16, spec_policy="always",
                                                                 prefix_cache=0))
    ref = prefilled(fresh, prompts[2])
    dlength = fresh.dpool.lengths[0]
    assert (row.root, cached.dpool.lengths[0], row.dpairs) == (ref.root, dlength, ref.dpairs)
    assert row.state is not None and ref.state is not None
    torch.testing.assert_close(row.state.logits, ref.state.logits, rtol=1e-9, atol=1e-9)
    for got, want in zip(cached.dpool.k, fresh.dpool.k, strict=True):
        torch.testing.assert_close(got[0, :, :dlength], want[0, :, :dlength], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("invariant", [False, True])
def test_hits_give_the_keys_and_values_of_a_prompt_computed_from_scratch(invariant):
    """bf16, where a chunk's row results can depend on its length: every engine (the default's and a
    batch-invariant one) reuses whole prefill chunks only, so the prompt's cache after prefill equals, bit
    for bit, a fresh engine's, and a repeated request gets the first one's answer (issue 50). (This tiny
    model's kernels give equal rows at any chunk length, so the hit's length is what shows the rule.)"""
    model = tiny_model(seed=5, dtype=torch.bfloat16)
    rng = random.Random(2)
    shared = [rng.randrange(4, 97) for _ in range(50)]
    first, second = shared + [5, 6, 7], shared + [9] * 11
    options = GenerateOptions(max_new_tokens=3, stop_token_ids=())
    config = BatchConfig(slots=1, prefill_chunk=32, spec_policy="never", batch_invariant=invariant)
    engine = BatchEngine(model, Tok(), config=config)
    run_all(engine, [first], options)
    assert engine.add("b", second, options) == 32  # 50 shared tokens: a whole chunk of 32, not 3 blocks of 16
    while not engine.decoding:
        engine.step()
    fresh = BatchEngine(model, Tok(), config=config)
    fresh.add("b", second, options)
    while not fresh.decoding:
        fresh.step()
    assert engine.rows[0].root == fresh.rows[0].root
    n = len(second)
    for got, want in zip((*engine.tpool.k, *engine.tpool.v), (*fresh.tpool.k, *fresh.tpool.v), strict=True):
        assert torch.equal(got[0, :, :n], want[0, :, :n])


def test_the_cache_is_allocated_with_the_pool_and_its_size_reported(model):
    """Made with the KV pool (a cache too large fails at startup, not in a request), taps included."""
    engine = BatchEngine(model, Tok(), random_drafter(model, 50, seed=1), SpecConfig(2, 2, 4),
                         BatchConfig(slots=2, slot_tokens=100, spec_policy="always"))
    assert engine.prefix_tokens == 100 and engine._prefix is None  # half of 2 slots x 100 tokens
    engine.allocate()
    prefix = engine._prefix
    assert prefix is not None and prefix.capacity == 6 and prefix.taps is not None
    assert prefix.nbytes == engine.prefix_bytes()
    assert prefix.taps.shape[-1] == 3 * model.config.hidden_size  # the drafter's three tapped layers
