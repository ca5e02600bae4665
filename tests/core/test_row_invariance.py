"""The default CPU format's promise (issue 47): with the row-invariant kernels (int8/4-bit linear layers in
core/csrc/rows_linear.cpp, few-query attention in small_attention.cpp) a token's logits are the same bits
whether it is decoded alone, verified among k others, or batched beside other requests; so greedy
speculative decoding equals plain decoding token for token in bf16, not only in float32."""

import pytest
import torch

from specdecode.core.quant import ROW_INVARIANT_ROWS, Int4Linear, quantize_weights
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import SpecConfig
from specdecode.runtime.native import load_native
from tests.helpers import eagle3_steps, perturbed, plain_steps, tiny_model

# every linear layer a multiple of 16 outputs (the family's tile) and of 32 inputs: vocab 96
SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def native():
    reason = load_native()
    if reason is not None or not hasattr(torch.ops.specdecode, "q4_rows"):
        pytest.skip(f"the row-invariant kernels need AVX-512 VNNI and a build: {reason or 'no AVX-512 VNNI'}")


def _to_q4(model, seed=0):
    """The projections as 4-bit blocks (random codes around the layer's own scale), the rest int8."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            w = getattr(parent, name).weight
            n, k = w.shape
            scale = w.float().abs().reshape(n, k // 32, 32).amax(-1) / 8
            q = torch.randint(0, 16, (n, k), generator=g)
            setattr(parent, name, Int4Linear(q, scale, torch.zeros_like(scale), torch.bfloat16))
    quantize_weights(model, "int8")
    return model


@pytest.fixture(params=["int8", "q4"])
def model(request, native):
    m = tiny_model(seed=4, dtype=torch.bfloat16, **SHAPE)
    if not all(hasattr(layer.self_attn, "qkv_proj") for layer in m.layers):
        pytest.skip("model layout changed")
    return _to_q4(m) if request.param == "q4" else (quantize_weights(m, "int8"), m)[1]


def _prefill(model, prompt):
    cache = model.new_cache(prompt.shape[0], 96)
    with torch.inference_mode():
        model(prompt, torch.arange(prompt.shape[1]), cache)
    return cache


def test_a_token_verified_among_k_is_the_token_decoded_alone(model):
    """k new tokens in one forward (a chain verify, causal) against k one-token forwards, k = 3, 8, 16."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (1, 21), generator=g)
    for k in (3, 8, ROW_INVARIANT_ROWS):
        new = torch.randint(0, 96, (1, k), generator=g)
        cache = _prefill(model, prompt)
        with torch.inference_mode():
            together = model(new, torch.arange(21, 21 + k), cache).logits[0]
        cache = _prefill(model, prompt)
        with torch.inference_mode():
            alone = torch.cat([model(new[:, i:i + 1], torch.tensor([21 + i]), cache).logits[0] for i in range(k)])
        assert torch.equal(together, alone), k


def test_a_request_batched_is_the_request_alone(model):
    """Four prompts of one length decoded in one batch, against each alone: the same logits, step by step."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 96, (4, 13), generator=g)
    steps = torch.randint(0, 96, (4, 5), generator=g)

    def decode(rows):
        cache = _prefill(model, prompts[rows])
        with torch.inference_mode():
            return torch.stack([model(steps[rows, i:i + 1], torch.tensor([13 + i]), cache).logits[:, 0]
                                for i in range(5)], 1)

    batched = decode(slice(0, 4))
    for r in range(4):
        assert torch.equal(batched[r], decode(slice(r, r + 1))[0]), r


@pytest.mark.parametrize("config", [SpecConfig(1, 1), SpecConfig(3, 1), SpecConfig(2, 2, 5), SpecConfig(4, 2, 10)],
                         ids=str)
def test_greedy_speculative_equals_plain_in_bf16(model, config):
    """A drafter that agrees with the target often but not always (the target perturbed, drafting for it):
    bf16 greedy speculative output is plain greedy decoding, token for token, with drafts accepted and
    rejected."""
    prompt = list(range(3, 12))
    drafter = SelfDrafter(perturbed(model, 0.05, 0), model, prompt[0])
    with torch.inference_mode():
        steps = list(eagle3_steps(model, drafter, prompt, 40, SamplingParams(), None, config))
        plain = [t for s in plain_steps(model, prompt, 40, SamplingParams()) for t in s.tokens]
    assert [t for s in steps for t in s.tokens][:40] == plain
    accepted = [s.cycle.accepted for s in steps if s.cycle]
    assert max(accepted) >= 1 and min(accepted) < config.max_depth  # both paths exercised


def test_compiled_steps_keep_the_bits_of_a_row(model):
    """Compiled steps too (inductor, ``core.compiled``): a verify of k tokens that also returns taps (the
    EAGLE-3 verify's graph) gives the bits of k one-token steps without taps (plain decoding's graph).
    Without ``emulate_precision_casts`` a fused kernel kept bf16 intermediates in float32 in one graph and
    not in the other, and greedy speculative output left plain decoding on real prompts."""
    from specdecode.core.compiled import CompiledRunner

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 96, (1, 21), generator=g)
    steps = CompiledRunner()
    for k in (2, 4):
        new = torch.randint(0, 96, (1, k), generator=g)
        cache = _prefill(model, prompt)
        with torch.inference_mode():
            together = steps.target(model, new, torch.arange(21, 21 + k), cache, hidden_layers=(1, 2)).logits[0]
        cache = _prefill(model, prompt)
        with torch.inference_mode():
            alone = torch.cat([steps.target(model, new[:, i:i + 1], torch.tensor([21 + i]), cache).logits[0]
                               for i in range(k)])
        assert torch.equal(together, alone), k


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_a_quantized_drafter_gives_a_row_its_bits_alone_in_a_tree_level_and_in_a_batch(model, fmt):
    """The drafter in the integer family (``--drafter-weights``): a draft row's logits are the same bits
    drafted alone, among a tree level's k rows, or in a batch beside other requests, and a re-extend of k
    pairs in one call gives each pair the bits of k calls of one."""
    from specdecode.core.drafter import random_drafter
    from specdecode.core.quant import quantize_linears

    drafter = random_drafter(model, 96, seed=3)
    quantize_linears(drafter, fmt)
    g = torch.Generator().manual_seed(5)
    width = 3 * model.config.hidden_size
    tokens = torch.randint(0, 96, (4, 3), generator=g)
    taps = torch.randn(4, 3, width, generator=g).to(torch.bfloat16)

    def draft(rows, per_call):
        cache = drafter.new_cache(32, len(range(*rows.indices(4))))
        with torch.inference_mode():
            return torch.cat([drafter(tokens[rows, i:i + per_call], taps[rows, i:i + per_call],
                                      torch.arange(i, i + per_call), cache)[0] for i in range(0, 3, per_call)], 1)

    batched = draft(slice(0, 4), 1)
    for r in range(4):
        alone = draft(slice(r, r + 1), 1)[0]
        assert torch.equal(batched[r], alone), r
        assert torch.equal(draft(slice(r, r + 1), 3)[0], alone), r
