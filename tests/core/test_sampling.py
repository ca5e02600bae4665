import pytest
import torch

from specdecode.core.sampling import SamplingParams, logits_to_probs, sample


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert int(sample(logits, SamplingParams(), None)) == 1


def test_temperature_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # the most likely token always survives
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert (probs > 0).tolist() == [True, False, False, False]


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = SamplingParams(temperature=1.0, seed=123)
    a = [int(sample(logits, params, g)) for g in [params.make_generator()] for _ in range(5)]
    b = [int(sample(logits, params, g)) for g in [params.make_generator()] for _ in range(5)]
    assert a == b
    gen = params.make_generator()
    draws = sample(logits.expand(20000, 3), params, gen)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits, -1), atol=0.015, rtol=0)


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_invalid_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_greedy_argmax_is_argmax_with_ties_to_the_first():
    from specdecode.core.sampling import greedy_argmax

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.randn(3, 4, 500).to(dtype)
        x[0, 1, 7] = x[0, 1, 300] = x[0, 1].max() + 1  # a tie: the first wins
        assert torch.equal(greedy_argmax(x), x.argmax(-1)) and int(greedy_argmax(x)[0, 1]) == 7
