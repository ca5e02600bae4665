"""Attention's arithmetic: rotary embeddings, GQA attention for few queries, and the masks.

Every batched call (continuous batching, a speculative cycle's verify, draft levels and draft
catch-up, a compiled step) attends over per-row cache slots with a ``[B, T, S]`` mask built by
one function, ``rows_mask``: row b sees its own first ``prefix[b]`` cache entries, then its new
entries as a local mask says (causal, a draft tree, ancestors). ``build_attention_mask`` and
``static_form`` turn the append-at-``cache.length`` form of ``Transformer.forward`` (one request,
its own cache) into the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.core.kernels import native_loaded
from specdecode.core.kvcache import KVCache


class RopeConfig(Protocol):
    """What the rotary tables need of a model config (``core.model.ModelConfig``)."""

    @property
    def head_dim(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...


def rope_inv_freq(config: RopeConfig) -> Tensor:
    dim = config.head_dim
    # fp32 arithmetic in the same order as transformers, so fp32 logits match it closely.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    else:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3"
        )
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] from rope_cos_sin (rotate-half convention, as
    in HF: x * cos + cat(-x2, x1) * sin). The halves swap with one roll and the sign lives in the
    table's first half: bit-identical, 3 ops fewer (about 2% of a decode step)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# Decode and verify steps (few queries) fold each KV group's query heads into the query axis:
# one SDPA call over [B, kv_heads, group * T] queries and the cache's own [B, kv_heads, S] keys,
# no repeated keys and no shape-specific primitive. Measured here (bf16, 2 threads, 1 query,
# 9 heads over 3 KV heads, us per layer call, a new cache length every call as in decoding):
# 34 at 200 keys, 84 at 1000; explicit bf16 matmuls (q @ k^T, softmax, @ v) took 980-1150,
# because oneDNN builds a new matmul primitive for every new key count (62 at a fixed length);
# the same matmuls in fp32 49-78, plus a cache copy to fp32.
SMALL_QUERY = 16


# bf16 decode and verify calls (1-16 query tokens a row) on a CPU run the project's own kernels (runtime.native):
# the AVX-512 BF16 one where loaded (heads a multiple of 32), else the AVX2 one; fixed per machine and model, so
# every call of a run takes the same one. A query's result depends only on the keys it sees (not on the key
# count or the other queries), so a token verified among k gets the bits it gets decoded alone, which SDPA
# (another summation order per query count) does not give; with the row-invariant linear kernels (core.quant)
# greedy speculative output equals plain decoding. fp32 and float64 stay on SDPA: exactness tests and `check`
# compare them with transformers token for token. Figures: benchmarks/results/attention-avx512/.
NATIVE_ATTENTION = "small_attention"
NATIVE_ATTENTION_AVX512 = "small_attention_avx512"
NATIVE_ATTENTION_TOKENS = SMALL_QUERY


def attention_op(q: Tensor) -> str | None:
    """The project's kernel a few-query call with ``q`` [B, H, T, D] runs, or None (SDPA)."""
    if not (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[2] <= NATIVE_ATTENTION_TOKENS):
        return None
    if q.shape[3] % 32 == 0 and native_loaded(NATIVE_ATTENTION_AVX512):
        return NATIVE_ATTENTION_AVX512
    return NATIVE_ATTENTION if native_loaded(NATIVE_ATTENTION) else None


def native_attention(q: Tensor) -> bool:
    """Whether a few-query call with ``q`` [B, H, T, D] runs one of the project's kernels rather than SDPA."""
    return attention_op(q) is not None


def small_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """GQA attention for few queries. q [B, H, T, D]; k, v [B, KV, S, D]; mask broadcastable
    to [B, 1, T, S] (True = attend)."""
    B, H, T, D = q.shape
    kv, S = k.shape[1], k.shape[2]
    g = H // kv
    qg = q.reshape(B, kv, g * T, D)  # heads of a group share their k/v: queries (head, token) of the group
    op = attention_op(q)
    if op is not None:
        rows = None if mask is None else mask.reshape(-1, T, S)
        out = getattr(torch.ops.specdecode, op)(qg, k, v, rows, T)
        return cast(Tensor, out).view(B, H, T, D)
    if mask is not None:
        mask = mask.reshape(-1, 1, 1, T, S).expand(-1, 1, g, T, S).reshape(-1, 1, g * T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(B, H, T, D)  # CUDA's SDPA kernels may return another layout (a view fails there)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables [B, 1, T, D] for positions [B, T], for apply_rope: the sin
    table's first half is negated (HF's sin is the same in both halves)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, D/2]
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1)[:, None].cos().to(dtype), torch.cat((-sin, sin), dim=-1)[:, None].to(dtype)


def rows_mask(prefix: Sequence[int], local: Tensor, span: int) -> Tensor:
    """The mask of a batch of rows, [n, T, span] bool (True = attend): row b's queries see its
    first ``prefix[b]`` keys, and key ``prefix[b] + j`` where ``local[b, t, j]`` ([n, T, L]: causal
    for new tokens, a tree's ancestors). Local entries past ``span`` must be False (padding of rows
    shorter than the longest). A query that would see nothing (padding) sees key 0, so its softmax
    stays finite. ``prefix`` is host ints (the rows' lengths, known without a device sync)."""
    n, T, L = local.shape
    device = local.device
    p = prefix[0]
    if all(x == p for x in prefix) and p + L <= span:  # one length (a request alone): three pieces, no scatter
        mask = torch.cat((torch.ones(n, T, p, dtype=torch.bool, device=device), local,
                          torch.zeros(n, T, span - p - L, dtype=torch.bool, device=device)), dim=-1)
    else:
        starts = torch.tensor(list(prefix), device=device)
        keys = torch.arange(span, device=device)
        base = (keys[None, None, :] < starts[:, None, None]).expand(n, T, span).to(torch.uint8)
        at = (starts[:, None] + torch.arange(L, device=device)).clamp(max=span - 1)  # clamped: False entries only
        mask = base.scatter_reduce(2, at[:, None, :].expand(n, T, L), local.to(torch.uint8), reduce="amax").bool()
    if min(prefix) == 0:  # only then can a query see nothing
        mask[:, :, 0] |= ~mask.any(-1)
    return mask


def resolve_call(cache: KVCache, B: int, T: int, attention_mask: Tensor | None, slots: Tensor | None,
                 static: bool, device: torch.device, what: str = "KV cache") -> tuple[int | Tensor, Tensor | None]:
    """Where a forward of T tokens per row writes its keys and what it attends, for
    ``Transformer.forward`` and a drafter's: per-row ``slots`` with their [B, T, S] mask, or append
    at ``cache.length`` (mask None: causal, or a [.., T, T] / [.., T, S] mask); ``static``: in the
    static form compiled steps take (slots [B, T] and a [B, 1, T, S] mask)."""
    if slots is not None:
        return slots, slot_attention_mask(attention_mask, slots, cache.max_len)
    if cache.length + T > cache.max_len:
        raise ValueError(f"sequence of {cache.length + T} tokens exceeds the {what} ({cache.max_len}); use a shorter "
                         "prompt / fewer new tokens or a larger max_len")
    mask = build_attention_mask(attention_mask, T, cache.length, device)
    if static:
        return static_form(mask, B, T, cache.length, device)
    return cache.length, mask


def static_form(mask: Tensor | None, B: int, T: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """A call appending T tokens at ``length`` in the static form compiled steps take: slots [B, T]
    and a full [B, 1, T, length + T] mask (``mask`` from build_attention_mask)."""
    slots = (length + torch.arange(T, device=device)).expand(B, T)
    full = (torch.ones(1, 1, T, length + T, dtype=torch.bool, device=device) if mask is None
            else mask.view(-1, 1, T, length + T))
    return slots, full.expand(B, 1, T, -1)


def slot_attention_mask(mask: Tensor | None, slots: Tensor, max_len: int) -> Tensor:
    """Check a per-row [B, T, S] mask against per-row ``slots`` [B, T]; the SDPA shape."""
    B, T = slots.shape
    if mask is None or mask.dim() != 3 or mask.shape[:2] != (B, T):
        raise ValueError(f"per-row cache slots [{B}, {T}] need a [{B}, {T}, S] attention mask, got "
                         f"{None if mask is None else tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool, got {mask.dtype}")
    # the highest slot is checked on the CPU only: on an accelerator it would cost a device sync every step
    # (an out-of-range slot fails in the indexing kernel there); slot max_len is the scratch slot
    if mask.shape[-1] > max_len or (slots.device.type == "cpu" and int(slots.max()) > max_len):
        raise ValueError(f"cache slots up to {int(slots.max())} (keys {mask.shape[-1]}) exceed the KV cache "
                         f"({max_len}); use shorter requests or larger slots")
    return mask.view(B, 1, T, -1)


def build_attention_mask(mask: Tensor | None, T: int, start: int, device: torch.device) -> Tensor | None:
    """The SDPA mask for T new tokens after ``start`` cached ones (see Transformer.forward)."""
    S = start + T
    if mask is None:
        if T == 1:
            return None
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool, got {mask.dtype}")
    if mask.shape[-1] == T and S != T:
        prefix = torch.ones(*mask.shape[:-1], start, dtype=torch.bool, device=mask.device)
        mask = torch.cat((prefix, mask), dim=-1)
    if mask.shape[-2:] != (T, S):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected [..., {T}, {T} or {S}]")
    return mask.view(-1, 1, T, S) if mask.dim() == 3 else mask
