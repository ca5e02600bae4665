"""The one per-row mask builder (``core.attention.rows_mask``) against a mask written out by hand."""

import torch

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
