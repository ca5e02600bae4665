"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded.

``logits_to_probs`` is the single definition of the target distribution; speculative
sampling (which must preserve it exactly) uses the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities (fp32, last dim) after temperature, top-k and top-p filtering."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token id per row of ``probs`` ([..., V] -> [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.view(probs.shape[:-1])


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Next token ids for logits [..., V]: argmax when greedy, else a seeded draw."""
    if params.greedy:
        return greedy_argmax(logits)
    return sample_from_probs(logits_to_probs(logits, params), generator)


def greedy_argmax(logits: Tensor) -> Tensor:
    """argmax over the last dimension (the first index on ties, as argmax). ``max().indices``:
    on CPU, bf16 ``argmax`` over SmolLM2's 49152 logits took 169 us, ``max`` 34 us (one call
    per decoded token)."""
    return logits.max(dim=-1).indices
