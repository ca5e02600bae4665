"""The model on tiny random weights (float64): shapes, cache, rollback, masks, positions."""

import pytest
import torch
import torch.nn.functional as F

from specdecode.core.kernels import Linear
from specdecode.core.model import ModelConfig
from tests.helpers import tiny_model


def run(model, tokens, cache, positions=None, mask=None, **kw):
    t = torch.tensor([tokens])
    if positions is None:
        positions = torch.arange(cache.length, cache.length + len(tokens))
    return model(t, torch.as_tensor(positions), cache, attention_mask=mask, **kw)


def test_shapes_and_hidden_taps():
    model = tiny_model()
    cache = model.new_cache(2, 32)
    tokens = torch.randint(0, 97, (2, 5))
    out = model(tokens, torch.arange(5), cache, hidden_layers=(2, 3, 6))
    assert out.logits.shape == (2, 5, 97)
    assert [h.shape for h in out.hidden_states] == [(2, 5, 64)] * 3
    assert cache.length == 5
    assert model.config.eagle3_aux_layer_ids == (2, 3, 3)
    # the hidden state entering layer 2 is what layers 0 and 1 produce
    cache2 = model.new_cache(2, 32)
    x = model.embed_tokens(tokens)
    cos, sin = model.rope(torch.arange(5).expand(2, 5))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    for i in range(2):
        x = model.layers[i](x, cos, sin, cache2.k[i], cache2.v[i], 0, mask)
    torch.testing.assert_close(out.hidden_states[0], x)


def test_logits_at_selects_positions():
    model = tiny_model()
    tokens = [5, 9, 11, 3]
    full = run(model, tokens, model.new_cache(1, 16)).logits
    last = run(model, tokens, model.new_cache(1, 16), logits_at=torch.tensor([-1])).logits
    torch.testing.assert_close(last[0, 0], full[0, -1])


def test_incremental_decode_matches_full_prefill():
    model = tiny_model()
    tokens = [3, 17, 42, 8, 64, 1, 90, 33]
    full = run(model, tokens, model.new_cache(1, 16)).logits[0]
    cache = model.new_cache(1, 16)
    step = [run(model, [t], cache).logits[0, 0] for t in tokens]
    torch.testing.assert_close(torch.stack(step), full, rtol=0, atol=1e-10)
    # chunked: 3 + 5
    cache = model.new_cache(1, 16)
    a = run(model, tokens[:3], cache).logits[0]
    b = run(model, tokens[3:], cache).logits[0]
    torch.testing.assert_close(torch.cat([a, b]), full, rtol=0, atol=1e-10)


def test_truncate_rolls_back():
    model = tiny_model()
    cache = model.new_cache(1, 16)
    run(model, [1, 2, 3], cache)
    expected = run(model, [4, 5], cache).logits
    cache.truncate(3)
    run(model, [50, 60, 70], cache)  # rejected candidates
    cache.truncate(3)
    torch.testing.assert_close(run(model, [4, 5], cache).logits, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        cache.truncate(99)


def tree_mask(parents):
    """Ancestor-or-self mask for nodes given parent indices (-1 = root)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_tree_mask_verification_equals_each_path():
    model = tiny_model(seed=1)
    prefix = [7, 8, 9, 10]
    # tree:     0(a)
    #          /    \
    #       1(b)    2(c)
    #        |     /   \
    #       3(d) 4(e)  5(f)
    nodes = [11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 0, 1, 2, 2]
    depth = [0, 1, 1, 2, 2, 2]
    cache = model.new_cache(1, 32)
    run(model, prefix, cache)
    L = cache.length
    out = run(model, nodes, cache, positions=[L + d for d in depth], mask=tree_mask(parents)).logits[0]
    paths = {3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 5]}
    for path in paths.values():
        ref_cache = model.new_cache(1, 32)
        ref = run(model, prefix + [nodes[i] for i in path], ref_cache).logits[0, len(prefix):]
        torch.testing.assert_close(out[path], ref, rtol=0, atol=1e-10)


def test_keep_compacts_accepted_path():
    model = tiny_model(seed=2)
    prefix = [7, 8, 9, 10]
    nodes = [11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 0, 1, 2, 2]
    depth = [0, 1, 1, 2, 2, 2]
    cache = model.new_cache(1, 32)
    run(model, prefix, cache)
    L = cache.length
    run(model, nodes, cache, positions=[L + d for d in depth], mask=tree_mask(parents))
    accepted = [0, 2, 5]
    cache.keep(L, torch.tensor(accepted) + L)
    assert cache.length == L + 3
    after = run(model, [40, 41], cache).logits
    ref = run(model, prefix + [nodes[i] for i in accepted] + [40, 41], model.new_cache(1, 32)).logits
    torch.testing.assert_close(after[0], ref[0, -2:], rtol=0, atol=1e-10)


def test_full_mask_with_left_padding_matches_unpadded():
    model = tiny_model(seed=3)
    short, long = [5, 6, 7], [1, 2, 3, 4, 5]
    pad = len(long) - len(short)
    tokens = torch.tensor([[0] * pad + short, long])
    valid = torch.tensor([[False] * pad + [True] * len(short), [True] * len(long)])
    mask = torch.ones(5, 5, dtype=torch.bool).tril() & valid[:, None, :]
    mask |= torch.eye(5, dtype=torch.bool)  # padded rows attend to themselves: no NaN
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    out = model(tokens, positions, model.new_cache(2, 16), attention_mask=mask).logits
    ref = run(model, short, model.new_cache(1, 16)).logits
    torch.testing.assert_close(out[0, pad:], ref[0], rtol=0, atol=1e-10)


def test_context_overflow_is_a_clear_error():
    model = tiny_model()
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        run(model, [1, 2, 3, 4, 5], cache)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(1, rows, 48)
    assert layer(x3).shape == (1, rows, 80)


def test_bf16_runs():
    model = tiny_model(dtype=torch.bfloat16)
    out = run(model, [1, 2, 3], model.new_cache(1, 8))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_config_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                    num_kv_heads=2)


@pytest.mark.parametrize("T,masked", [(1, False), (1, True), (5, True), (16, True)])
def test_small_query_attention_matches_sdpa(T, masked):
    from specdecode.core.attention import small_query_attention

    torch.manual_seed(T)
    B, H, KV, S, D = 2, 6, 2, 40, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    mask = (torch.rand(B, 1, T, S) > 0.3) | torch.eye(T, S, dtype=torch.bool) if masked else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(small_query_attention(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)
    if masked:  # the 2-D [T, S] form used for trees
        torch.testing.assert_close(small_query_attention(q, k, v, mask[0, 0]),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0, 0], enable_gqa=True),
                                   rtol=1e-5, atol=1e-5)
