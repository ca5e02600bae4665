"""EAGLE-3 draft head (the module; its checkpoint format lives in ``specdecode.io.checkpoints``).

The draft is one Llama decoder layer. Its first step fuses three target hidden states
(``fc: 3*H_target -> H``); its attention input is ``[input_layernorm(embedding),
hidden_norm(hidden)]`` (2H wide); its own ``lm_head`` covers a reduced draft vocabulary
mapped back to target ids by ``d2t`` (``target_id = i + d2t[i]``); ``t2d`` marks which
target ids are in the draft vocabulary. Later draft steps feed the draft's own output
hidden state back (H wide, no ``fc``). The token embedding is the target's, shared.
``aux_layer_ids`` are the target layers whose *input* hidden states are fused.

Variants (``DrafterConfig``'s flags, as SpecForge and vLLM's speculators name them): an RMSNorm
on each tap before ``fc`` (``fc_norm``, EAGLE-3.1) or on their concatenation (``norm_before_fc``),
the layer's residual taken after ``hidden_norm`` (``norm_before_residual``), and later steps fed
the normed output instead of the raw one (``feed_normed``, speculators' ``norm_output``, EAGLE-3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from specdecode.core.attention import resolve_call, rope_cos_sin, rope_inv_freq
from specdecode.core.kernels import Linear
from specdecode.core.kvcache import KVCache
from specdecode.core.model import MLP, Attention, ModelConfig, RMSNorm, Transformer

# a variant's flags: their checkpoint names (SpecForge's, speculators') -> DrafterConfig's fields
VARIANT_FLAGS = {"fc_norm": "fc_norm", "norm_before_fc": "norm_before_fc",
                 "norm_before_residual": "norm_before_residual", "norm_output": "feed_normed"}


@dataclass
class DrafterConfig:
    layer: ModelConfig  # the one decoder layer (num_layers = 1), rope settings included
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose *input* hidden states are fused
    fc_norm: bool = False  # an RMSNorm on each tap before fc (fc_norm.{i}: EAGLE-3.1)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated taps before fc (input_norm)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(hidden), not hidden
    feed_normed: bool = False  # later steps read norm(h), not h (speculators' norm_output: EAGLE-3.1)

    def __post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc both normalize fc's input: choose one")

    @property
    def variant(self) -> tuple[str, ...]:
        """The flags set, by their checkpoint names (empty: EAGLE-3 as published)."""
        return tuple(name for name, field in VARIANT_FLAGS.items() if getattr(self, field))

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
        n_aux, width = len(config.aux_layer_ids), config.target_hidden_size
        self.fc = Linear(n_aux * width, c.hidden_size, bias=False)
        self.fc_norm = (nn.ModuleList(RMSNorm(width, c.rms_norm_eps) for _ in range(n_aux))
                        if config.fc_norm else None)
        self.input_norm = RMSNorm(n_aux * width, c.rms_norm_eps) if config.norm_before_fc else None
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

    # the final norm's weight: in the compute dtype whatever format the linear layers are in (core.quant)
    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

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
            hidden = self.fuse(hidden)
        x, residual = self.layer_input(self.embed_tokens(tokens), hidden)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        h = self.layer_output(residual, self.midlayer.self_attn(x, cos, sin, ks[0], vs[0], start, mask))
        return self.head(h), self.feedback(h)

    # The layer's arithmetic around its attention, shared with training (training.ttt.ttt_forward)

    def fuse(self, taps: Tensor) -> Tensor:
        """The target's concatenated taps [.., n_aux*H_t] -> the first step's hidden state [.., H]."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        if self.fc_norm is not None:
            chunks = taps.chunk(len(self.fc_norm), -1)
            taps = torch.cat([norm(t) for norm, t in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(taps)

    def layer_input(self, embedding: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(the attention's 2H input, the residual the attention's output is added to)."""
        m = self.midlayer
        normed = m.hidden_norm(hidden)
        return (torch.cat((m.input_layernorm(embedding), normed), dim=-1),
                normed if self.config.norm_before_residual else hidden)

    def layer_output(self, residual: Tensor, attention: Tensor) -> Tensor:
        h = residual + attention
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))

    def head(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits of the layer's output ``h``."""
        return self.lm_head(self.norm(h))

    def feedback(self, h: Tensor) -> Tensor:
        """What the next draft step reads in place of the target's taps."""
        return self.norm(h) if self.config.feed_normed else h

    if TYPE_CHECKING:  # nn.Module.__call__ is untyped in torch's stubs; calling runs forward
        __call__ = forward


def with_variant(config: DrafterConfig, variant: Sequence[str]) -> DrafterConfig:
    """``config`` with the flags ``variant`` names (checkpoint names, see ``DrafterConfig.variant``) set."""
    unknown = [v for v in variant if v not in VARIANT_FLAGS]
    if unknown:
        raise ValueError(f"unknown drafter variant(s) {unknown}; known: {', '.join(VARIANT_FLAGS)}")
    flags: dict[str, Any] = {VARIANT_FLAGS[v]: True for v in variant}
    return replace(config, **flags)


# ---------------------------------------------------------------- construction

def random_drafter(target: Transformer, draft_vocab_size: int | None = None, seed: int = 0,
                   init_std: float = 0.02, variant: Sequence[str] = ()) -> Eagle3Drafter:
    """An untrained drafter wired to ``target`` (tests, profiling before training).
    The draft vocabulary is the first ``draft_vocab_size`` target ids; ``variant`` names
    ``DrafterConfig``'s flags to set, by their checkpoint names (``DrafterConfig.variant``)."""
    t = target.config
    vd = draft_vocab_size or t.vocab_size
    layer = ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                        num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, rms_norm_eps=t.rms_norm_eps,
                        max_position_embeddings=t.max_position_embeddings)
    config = with_variant(DrafterConfig(layer, vd, t.hidden_size, default_aux_layer_ids(t)), variant)
    drafter = Eagle3Drafter(config, target.embed_tokens)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
        drafter.t2d[:vd] = True
    return drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
