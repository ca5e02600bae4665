"""core.quant: weight-only int8 linear layers (per-channel scales) and the model-wide switch."""

import pytest
import torch

from specdecode.core.drafter import random_drafter
from specdecode.core.kernels import Linear
from specdecode.core.lossless import check_lossless
from specdecode.core.quant import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    Int8Linear,
    detect_format,
    quantize_linears,
    quantize_weights,
    set_activations,
)
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from tests.core.helpers import PROMPTS, DigitTokenizer
from tests.helpers import tiny_model


def test_int8_linear_is_its_dequantized_weight_and_close_to_the_original():
    torch.manual_seed(0)
    w, b = torch.randn(24, 16, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    w[3] = 0.0  # an all-zero channel: no division by zero
    layer = Int8Linear(w, b)
    q, s = layer.weight_int8, layer.scales
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.shape == (24,)
    assert (q.abs().amax(dim=1)[torch.arange(24) != 3] == 127).all()  # symmetric: each row's max maps to 127
    assert (layer.dequantized() - w).abs().le(s[:, None] / 2 + 1e-12).all()  # rounding error at most half a step
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.dequantized().t() + b, rtol=1e-12, atol=1e-12)  # float64
    assert layer(x).shape == (2, 5, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_agrees_with_the_formula(dtype):
    torch.manual_seed(1)
    layer = Int8Linear(torch.randn(64, 32).to(dtype))
    for rows in (1, 3, 8, 17, 32, 33, 100):  # the kernel up to 32 rows, convert + GEMM beyond: one formula
        x = torch.randn(rows, 32).to(dtype)
        ref = x.double() @ layer.weight_int8.double().t() * layer.scales.double()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (layer(x).double() - ref).abs().max() <= tol * ref.abs().max()


def test_quantize_weights_swaps_every_linear_and_unties_lm_head():
    model = tiny_model(dtype=torch.float32, tie_word_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    embedding = model.embed_tokens.weight.clone()
    linears = sum(isinstance(m, Linear) for m in model.modules())
    assert quantize_weights(model, "native") == 0 and detect_format(model) == "native"
    assert quantize_weights(model, "int8") == linears and detect_format(model) == "int8"
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear) and torch.equal(model.embed_tokens.weight, embedding)
    with pytest.raises(ValueError, match="use one of native, int8"):
        quantize_weights(model, "int4")


def test_speculative_greedy_is_lossless_on_int8_weights():
    """The int8 model is one function whatever the rows: greedy speculative output equals its
    own greedy baseline (fp32 activations, through the CPU kernel)."""
    model = tiny_model(dtype=torch.float32)
    quantize_weights(model, "int8")
    decoder = Eagle3Decoder(random_drafter(model, 60, seed=1), SpecConfig(3, 2, 6))
    report = check_lossless(model, DigitTokenizer(), lambda ids: decoder, PROMPTS, max_new_tokens=16)
    assert report.passed and report.rows and all(r["accept_length"] >= 1.0 for r in report.rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_every_int4_kernel_is_the_formula(dtype, onednn_bf16, monkeypatch):
    """Every kernel, on a CPU whose oneDNN runs bf16 and on one whose does not (AVX2: then a bf16 layer
    offers its weight in fp32, ``onednn_f32``)."""
    import specdecode.core.kernels as kernels
    from specdecode.core.quant import ROW_INVARIANT_ROWS, Int4Linear

    if onednn_bf16 and not kernels.onednn_usable(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU's oneDNN has no bf16")
    monkeypatch.setattr(kernels, "_onednn_bf16", lambda: onednn_bf16)

    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (48, 64), generator=g)
    scales, zeros = torch.rand(48, 2, generator=g) / 10 + 0.01, torch.randn(48, 2, generator=g) / 10
    layer = Int4Linear(q, scales, zeros, dtype)
    w = (q.double() - 8) * scales.double().repeat_interleave(32, 1) + zeros.double().repeat_interleave(32, 1)
    torch.testing.assert_close(layer.dequantized().double(), w, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    many = ROW_INVARIANT_ROWS + 1  # up to that many rows the row-invariant family, where loaded, runs alone
    assert "int4pack" in layer.kernel_candidates(many)
    f32 = dtype == torch.bfloat16 and not onednn_bf16
    assert ("onednn_f32" in layer.kernel_candidates(many)) == f32
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        ref = x.double() @ w.t()
        for kernel in (*layer.kernel_candidates(rows), "aten"):
            kernels.pack(layer, [kernel])
            err = (layer.run_kernel(kernel, x).double() - ref).abs().max() / ref.abs().max()
            assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-5), (kernel, rows, float(err))
    assert layer(torch.randn(2, 3, 64).to(dtype)).shape == (2, 3, 48)
    odd = Int4Linear(q[:40], scales[:40], zeros[:40], dtype)  # the 4-bit kernel packs 16 rows at a time
    assert "int4pack" not in odd.kernel_candidates(many) and odd(torch.randn(1, 64).to(dtype)).shape == (1, 40)


def test_int4_refuses_bad_blocks():
    from specdecode.core.quant import Int4Linear

    with pytest.raises(ValueError, match="groups of 32"):
        Int4Linear(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1), torch.float32)
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(torch.full((4, 32), 16), torch.ones(4, 1), torch.zeros(4, 1), torch.float32)


def test_activations_set_each_kind_of_layer():
    """--activations: every int8 layer takes the default's bits when quantized; mixed gives the attention
    projections and down_proj int16 and the rest int8; an unknown choice is refused with the known ones."""
    model = tiny_model(dtype=torch.bfloat16)
    n = quantize_weights(model, "int8")
    layers = {path.rsplit(".", 1)[-1]: m for path, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert {"qkv_proj", "down_proj", "gate_up_proj", "o_proj", "lm_head"} <= set(layers)
    default = ACTIVATIONS[DEFAULT_ACTIVATIONS]
    assert all(m.act_bits == default.get(kind, default["*"]) for kind, m in layers.items())
    assert set_activations(model, "mixed") == n
    bits = {path.rsplit(".", 1)[-1]: m.act_bits for path, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert bits == {"qkv_proj": 16, "down_proj": 16, "gate_up_proj": 8, "o_proj": 8, "lm_head": 8}
    with pytest.raises(ValueError, match="unknown activations 'int4'; use one of int16, int8, mixed"):
        set_activations(model, "int4")


def test_q4_quantization_is_no_worse_than_rounding_between_each_groups_extremes():
    """Each group's range searched and its scale and offset refitted: never more error than plain rounding
    between the group's minimum and maximum (a candidate of the search), a constant group kept exactly."""
    from specdecode.core.quant import quantize_q4

    torch.manual_seed(3)
    w = torch.randn(32, 96, dtype=torch.float64)
    w[:, 40] *= 6  # an outlier in a group: there the search pays most
    w[5, :32] = 0.7
    got = (quantize_q4(w).dequantized().double() - w).reshape(32, 3, 32).pow(2).sum(-1)
    g = w.reshape(32, 3, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(1e-30)
    plain = (torch.round((g - lo) / step).clamp(0, 15) * step + lo - g).pow(2).sum(-1)
    assert (got <= plain * (1 + 1e-3) + 1e-9).all() and got.sum() < 0.95 * plain.sum()
    assert got[5, 0] < 1e-9
    mixed = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 32, bias=False))
    with pytest.raises(ValueError, match=r"1 \(16 inputs, bias: False\): the 4-bit format takes whole groups"):
        quantize_linears(mixed, "q4")
    assert detect_format(mixed) == "native"  # refused before any layer changed
    with pytest.raises(ValueError, match="no bias; use --drafter-weights int8 or native"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)), "q4")
    with pytest.raises(ValueError, match="unknown drafter weight format 'int4'"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)), "int4")


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_a_quantized_drafter_swaps_its_own_layers_and_stays_lossless(fmt):
    """Every linear layer of the head (fc, attention, MLP, lm_head) in the format, the target's embedding it
    holds untouched; the target verifies, so greedy speculative output is still plain decoding's."""
    model = tiny_model(dtype=torch.float32, vocab_size=96, hidden_size=64, intermediate_size=96, num_heads=4,
                       num_kv_heads=2)
    drafter = random_drafter(model, 64, seed=1)
    embedding = model.embed_tokens.weight.clone()
    linears = sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    assert quantize_linears(drafter, fmt) == linears == 6 and detect_format(drafter) == fmt
    assert torch.equal(model.embed_tokens.weight, embedding) and detect_format(model) == "native"
    assert drafter.dtype == torch.float32
    decoder = Eagle3Decoder(drafter, SpecConfig(3, 2, 6))
    report = check_lossless(model, DigitTokenizer(), lambda ids: decoder, PROMPTS, max_new_tokens=16)
    assert report.passed and report.rows
