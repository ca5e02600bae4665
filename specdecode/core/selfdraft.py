"""A drafter that proposes a (possibly different) full model's own tokens.

With the target itself as the proposer, every greedy proposal must be accepted
(accept length = depth + 1): a check of the tree, verify, accept and cache machinery
that does not depend on how well a drafter is trained. With a perturbed copy of the
target it gives partial acceptance, which exercises both accept and reject paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specdecode.core.kvcache import KVCache
from specdecode.core.model import Transformer


@dataclass
class SelfDraftConfig:
    aux_layer_ids: tuple[int, ...]


class SelfDrafter(nn.Module):
    """Drafter interface over a full model. Draft pair p = (hidden at p, token at p+1):
    the proposer runs that token at position p + 1 and ignores the hidden state.

    EAGLE's pairing never shows the drafter the prompt's first token, which a full
    model needs; it is given here (``first_token``) and run ahead of the first pair."""

    def __init__(self, proposer: Transformer, target: Transformer, first_token: int) -> None:
        super().__init__()
        if proposer.config.vocab_size != target.config.vocab_size:
            raise ValueError("the self-draft proposer must share the target's vocabulary")
        self.proposer = proposer
        self.first_token = first_token
        self.config = SelfDraftConfig(target.config.eagle3_aux_layer_ids)

    @property
    def device(self) -> torch.device:
        return self.proposer.device

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        return self.proposer.new_cache(batch_size, max_len)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
                attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        positions = positions.expand(tokens.shape) + 1
        skip = 0
        if slots is None and cache.length == 0:  # first call: put the prompt's first token in front
            first = torch.full_like(tokens[:, :1], self.first_token)
            tokens, positions = torch.cat((first, tokens), 1), torch.cat((torch.zeros_like(first), positions), 1)
            skip = 1
        logits = self.proposer(tokens, positions, cache, attention_mask=attention_mask, slots=slots).logits[:, skip:]
        return logits, torch.zeros(*logits.shape[:2], 1, dtype=logits.dtype, device=logits.device)

    if TYPE_CHECKING:  # nn.Module.__call__ is untyped in torch's stubs; calling runs forward
        __call__ = forward
