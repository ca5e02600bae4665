"""The one per-row mask builder (``core.attention.rows_mask``) against a mask written out by hand."""

import torch
import torch.nn.functional as F

from specdecode.core import attention
from specdecode.core.attention import rows_mask


def by_hand(prefix, local, span):
    n, T, L = local.shape
    mask = torch.zeros(n, T, span, dtype=torch.bool)
    for b in range(n):
        mask[b, :, :prefix[b]] = True
        for t in range(T):
            for j in range(L):
                if local[b, t, j]:
                    mask[b, t, prefix[b] + j] = True
            if not mask[b, t].any():
                mask[b, t, 0] = True
    return mask


def test_rows_mask_is_prefix_then_local_entries_per_row():
    gen = torch.Generator().manual_seed(0)
    prefix = torch.tensor([3, 0, 7, 5])
    local = torch.rand(4, 3, 4, generator=gen) > 0.5
    assert torch.equal(rows_mask(prefix, local, 11), by_hand(prefix, local, 11))


def test_padding_past_the_span_is_dropped_and_an_empty_query_sees_key_zero():
    prefix = torch.tensor([6, 0])
    local = torch.tensor([[[True, False, False]], [[False, False, False]]])  # row 0: entries 7, 8 would pass span 7
    mask = rows_mask(prefix, local, 7)
    assert mask[0, 0].tolist() == [True] * 7
    assert mask[1, 0].tolist() == [True] + [False] * 6  # nothing to see: key 0, so the softmax is finite
    assert torch.equal(mask, by_hand(prefix, local, 7))


def test_small_query_attention_takes_sdpa_output_in_any_layout(monkeypatch):
    # CUDA's SDPA kernels return [B, H, T, D] strided as [B, T, H, D] (seen on an H200: .view failed there)
    q, k, v = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 3, 5) > 0.3
    mask[..., 0] = True
    expected = attention.small_query_attention(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(attention.small_query_attention(q, k, v, mask), expected)
