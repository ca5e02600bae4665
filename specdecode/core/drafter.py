"""EAGLE-3 draft head (the module; its checkpoint format lives in ``specdecode.io.checkpoints``).

The draft is one Llama decoder layer. Its first step fuses three target hidden states
(``fc: 3*H_target -> H``); its attention input is ``[input_layernorm(embedding),
hidden_norm(hidden)]`` (2H wide); its own ``lm_head`` covers a reduced draft vocabulary
mapped back to target ids by ``d2t`` (``target_id = i + d2t[i]``); ``t2d`` marks which
target ids are in the draft vocabulary. Later draft steps feed the draft's own output
hidden state back (H wide, no ``fc``). The token embedding is the target's, shared.
``aux_layer_ids`` are the target layers whose *input* hidden states are fused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specdecode.core.attention import resolve_call, rope_cos_sin, rope_inv_freq
from specdecode.core.kernels import Linear
from specdecode.core.kvcache import KVCache
from specdecode.core.model import MLP, Attention, ModelConfig, RMSNorm, Transformer


@dataclass
class DrafterConfig:
    layer: ModelConfig  # the one decoder layer (num_layers = 1), rope settings included
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose *input* hidden states are fused

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def default_aux_layer_ids(target: ModelConfig) -> tuple[int, ...]:
    return target.eagle3_aux_layer_ids


class DraftLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Drafter(nn.Module):
    d2t: Tensor  # [draft_vocab] offsets: target id = draft id + d2t[draft id] (buffer)
    t2d: Tensor  # [vocab] bool: target ids in the draft vocabulary (buffer)

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        c = config.layer
        self.fc = Linear(len(config.aux_layer_ids) * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DraftLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # The target's embedding, shared (kept out of state_dict: not ours to save).
        self._embed = [embed_tokens]
        self.inv_freq = rope_inv_freq(c)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed[0]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache:
        c = self.config.layer
        return KVCache.allocate(1, batch_size, c.num_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
                attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One draft step for ``tokens`` [B, T] paired with ``hidden`` [B, T, 3*H_t] (fused
        target taps) or [B, T, H] (the draft's own output). Returns draft-vocab logits and
        the pre-norm output hidden state that the next step feeds back. ``slots``: per-row
        cache slots with a [B, T, S] mask, as in ``Transformer.forward``."""
        B, T = tokens.shape
        start, mask = resolve_call(cache, B, T, attention_mask, slots, False, tokens.device, "draft cache")
        if positions.dim() == 1:
            positions = positions.expand(B, T)
        logits, h = self.step(tokens, hidden, positions, start, mask, cache.k, cache.v)
        if slots is None:
            cache.advance(T)
        return logits, h

    def step(self, tokens: Tensor, hidden: Tensor, positions: Tensor, start: int | Tensor, mask: Tensor | None,
             ks: Sequence[Tensor], vs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """The draft layer and head; with tensor ``start`` (slots) and a [B, 1, T, S] mask, a static-shape
        step (as ``Transformer.step``)."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = torch.cat((layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)), dim=-1)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        h = hidden + layer.self_attn(x, cos, sin, ks[0], vs[0], start, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h

    if TYPE_CHECKING:  # nn.Module.__call__ is untyped in torch's stubs; calling runs forward
        __call__ = forward


# ---------------------------------------------------------------- checkpoint I/O

def random_drafter(target: Transformer, draft_vocab_size: int | None = None, seed: int = 0,
                   init_std: float = 0.02) -> Eagle3Drafter:
    """An untrained drafter wired to ``target`` (tests, profiling before training).
    The draft vocabulary is the first ``draft_vocab_size`` target ids."""
    t = target.config
    vd = draft_vocab_size or t.vocab_size
    layer = ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                        num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, rms_norm_eps=t.rms_norm_eps,
                        max_position_embeddings=t.max_position_embeddings)
    config = DrafterConfig(layer, vd, t.hidden_size, default_aux_layer_ids(t))
    drafter = Eagle3Drafter(config, target.embed_tokens)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
        drafter.t2d[:vd] = True
    return drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
