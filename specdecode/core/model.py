"""Llama-family decoder as a plain nn.Module with a preallocated, rollback-able KV cache.

One call does everything: prefill, single-token decode and verification of k candidate
tokens (chain or tree) are all ``forward(tokens, positions, attention_mask)``. Positions
are explicit because tree nodes share positions (depth) while occupying distinct cache
slots; the cache appends at its current length and speculative decoding rolls back or
compacts it afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.core.attention import (
    SMALL_QUERY,
    apply_rope,
    resolve_call,
    rope_cos_sin,
    rope_inv_freq,
    small_query_attention,
)
from specdecode.core.kernels import Linear
from specdecode.core.kvcache import KVCache


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    # None (the default): hidden_size // num_heads, filled in by __post_init__. Typed int because
    # every built config holds one; the None default is the "derive it" marker.
    head_dim: int = cast(int, None)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def eagle3_aux_layer_ids(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states EAGLE-3 fuses: {2, N//2, N-3}."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Variance in fp32 even for bf16 activations, as the reference implementation does
        # (fp64 stays fp64: exactness tests run tiny models in float64).
        xf = x if x.dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    __call__ = forward  # no hook dispatch: see Linear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # q, k and v fused in one matrix: one GEMV per layer instead of three.
        # (in_features: the EAGLE-3 draft layer attends over [embedding, hidden] = 2H.)
        self.qkv_proj = Linear(in_features or config.hidden_size, q + 2 * kv, bias=config.attention_bias)
        self.o_proj = Linear(q, config.hidden_size, bias=False)
        self.split = (q, kv, kv)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer_k: Tensor, layer_v: Tensor,
                start: int | Tensor, mask: Tensor | None) -> Tensor:
        """``start``: the cache slot of the first new token (every row appends there), or a
        [B, T] tensor of slots per row and token (rows of different lengths in one batch;
        keys are then slots ``[0, S)`` with S the mask's last dimension)."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # type: ignore[no-untyped-call]  # Tensor.split: untyped
        q = apply_rope(q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        if isinstance(start, Tensor):
            if mask is None:
                raise ValueError("per-row cache slots need an explicit [B, T, S] attention mask")
            rows = torch.arange(B, device=x.device)[:, None]
            layer_k[rows, :, start] = k.transpose(1, 2)  # [B, T, kv, D] at each row's slots
            layer_v[rows, :, start] = v.view(B, T, self.n_kv, self.head_dim)
            span = mask.shape[-1]
        else:
            layer_k[:, :, start:start + T] = k
            layer_v[:, :, start:start + T] = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            span = start + T
        keys, values = layer_k[:, :, :span], layer_v[:, :, :span]
        if T <= SMALL_QUERY:
            out = small_query_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    __call__ = forward  # no hook dispatch: see Linear


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    __call__ = forward  # no hook dispatch: see Linear


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer_k: Tensor, layer_v: Tensor,
                start: int | Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_k, layer_v, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    __call__ = forward  # no hook dispatch: see Linear


@dataclass
class ForwardOutput:
    logits: Tensor  # [B, T', vocab] (T' = len(logits_at) if given, else T)
    hidden_states: list[Tensor] = field(default_factory=list)  # hidden entering each tapped layer


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding's own init (normal_) imports torch._dynamo when the model is built on the meta
        # device, as every load does (io.hf): 2.6 s of each start on a 2-core EPYC. Same init otherwise.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(config)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        max_len = max_len or self.config.max_position_embeddings
        # Heads as the attention modules hold them: a sharded model (tensor parallelism) keeps
        # only its own KV heads, and its cache with it.
        attn = cast(DecoderLayer, self.layers[0]).self_attn if len(self.layers) else None
        kv_heads = attn.n_kv if attn is not None else self.config.num_kv_heads
        c = self.config
        return KVCache.allocate(c.num_layers, batch_size, kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.dtype)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache,
                attention_mask: Tensor | None = None,
                hidden_layers: Sequence[int] = (),
                logits_at: Tensor | None = None, slots: Tensor | None = None) -> ForwardOutput:
        """Run ``tokens`` [B, T] at ``positions`` [B, T] (or [T]), appending their keys and
        values to ``cache`` at slots ``cache.length ...``.

        attention_mask (bool, True = may attend): None means causal among the new tokens
        with the whole cached prefix visible; a [T, T] or [B, T, T] mask says which new
        tokens see each other (a draft tree) with the prefix visible; a [B, T, S] mask with
        S = cache.length + T gives full control (padding in batched generation).
        hidden_layers: indices of layers whose *input* hidden states to return.
        logits_at: indices along T for which to compute logits (prefill needs one).
        slots: [B, T] cache slot of each new token, per row (continuous batching: rows of
        different lengths); then ``attention_mask`` [B, T, S] is required, keys are slots
        ``[0, S)`` and ``cache.length`` is left to the caller.
        """
        B, T = tokens.shape
        taps = self.taps(hidden_layers)
        if positions.dim() == 1:
            positions = positions.expand(B, T)
        start, mask = resolve_call(cache, B, T, attention_mask, slots, False, tokens.device)
        x, hidden = self.layers_forward(tokens, positions, start, mask, cache.k, cache.v, taps)
        if logits_at is not None:
            x = x[:, logits_at]
        if slots is None:
            cache.advance(T)
        return ForwardOutput(self.lm_head(self.norm(x)), hidden)

    def taps(self, hidden_layers: Sequence[int]) -> tuple[int, ...]:
        """``hidden_layers`` checked: layer indices whose input hidden states a call returns (num_layers: the
        last layer's output)."""
        taps = tuple(hidden_layers)
        if any(not 0 <= i <= self.config.num_layers for i in taps):
            raise ValueError(f"hidden_layers {list(taps)} out of range for {self.config.num_layers} layers")
        return taps

    def layers_forward(self, tokens: Tensor, positions: Tensor, start: int | Tensor, mask: Tensor | None,
                       ks: Sequence[Tensor], vs: Sequence[Tensor],
                       taps: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        """Embedding and every layer (keys and values written at ``start``); the last hidden state
        (before the final norm) and the taps."""
        cos, sin = self.rope(positions)
        x: Tensor = self.embed_tokens(tokens)
        hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                hidden[i] = x
            x = layer(x, cos, sin, ks[i], vs[i], start, mask)
        if self.config.num_layers in taps:
            hidden[self.config.num_layers] = x
        return x, [hidden[i] for i in taps]

    def step(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, ks: Sequence[Tensor],
             vs: Sequence[Tensor], taps: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        """The static-shape step: tokens, positions, slots [B, T], mask
        [B, 1, T, S], every layer's cache tensor; no Python number derived from a length.
        Returns logits [B, T, V] and the taps."""
        x, hidden = self.layers_forward(tokens, positions, slots, mask, ks, vs, taps)
        return self.lm_head(self.norm(x)), hidden

    if TYPE_CHECKING:
        __call__ = forward
