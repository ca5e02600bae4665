"""Tensor parallelism over torch.distributed, applied to a built model (as gpt-fast does).

Per layer: q/k/v and gate/up are split by output rows (column parallel: each rank owns whole
KV-head groups and a slice of the MLP), o_proj and down_proj by input columns (row
parallel), each followed by one all-reduce. Embedding, norms and lm_head stay replicated,
so every rank computes the same logits and runs the same decode loop (SPMD): the engine,
the sampler and speculative decoding work unchanged, and the drafter runs replicated.

Heads need not divide evenly: SmolLM2 has 3 KV-head groups, so with 2 ranks one owns 2
groups and the other 1 (uneven work, same result).

Time inside collectives is measured by a ``CommMeter`` and shown as its own profiler phase.
Process groups and spawning the workers live in ``specdecode.runtime.distributed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor

from specdecode.core.kernels import Linear
from specdecode.core.model import DecoderLayer, Transformer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass
class CommMeter:
    """Cumulative time and traffic of this rank's all-reduces. On CUDA the device is
    synchronized around each call, so the time is the collective's, not its launch."""

    group: ProcessGroup | None = None  # None: the default process group
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def all_reduce(self, t: Tensor) -> None:
        cuda = t.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(t.device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        if cuda:
            torch.cuda.synchronize(t.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += t.numel() * t.element_size()


class RowParallelLinear(Linear):
    """A Linear holding a slice of the input columns; the partial outputs are summed across ranks."""

    def __init__(self, weight: Tensor, meter: CommMeter) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.meter = meter

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x).contiguous()
        self.meter.all_reduce(out)
        return out


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks as evenly as possible, larger shares first."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _rank_slice(n: int, rank: int, world: int) -> slice:
    sizes = split_sizes(n, world)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _column(linear: Linear, rows: Tensor) -> Linear:
    """A Linear keeping only output rows ``rows`` (bias too)."""
    out = Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    return out


def apply_tensor_parallel(model: Transformer, rank: int, world: int, group: ProcessGroup | None = None) -> CommMeter:
    """Shard ``model`` in place for ``rank`` of ``world``; returns the meter of its all-reduces."""
    cfg = model.config
    if world > cfg.num_kv_heads:
        raise ValueError(f"--tp {world}: the model has {cfg.num_kv_heads} KV heads; tensor parallelism splits whole "
                         f"KV-head groups, so use at most {cfg.num_kv_heads} ranks")
    meter = CommMeter(group)
    groups = _rank_slice(cfg.num_kv_heads, rank, world)
    n_kv = groups.stop - groups.start
    per_group = cfg.num_heads // cfg.num_kv_heads
    d = cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
    q_rows = torch.arange(groups.start * per_group * d, groups.stop * per_group * d)
    k_rows = q_dim + torch.arange(groups.start * d, groups.stop * d)
    v_rows = q_dim + kv_dim + torch.arange(groups.start * d, groups.stop * d)
    mlp = _rank_slice(cfg.intermediate_size, rank, world)
    gate_rows = torch.arange(mlp.start, mlp.stop)
    with torch.no_grad():
        for layer in model.layers:
            layer = cast(DecoderLayer, layer)
            attn = layer.self_attn
            attn.qkv_proj = _column(attn.qkv_proj, torch.cat((q_rows, k_rows, v_rows)))
            attn.o_proj = RowParallelLinear(attn.o_proj.weight.detach()[:, q_rows].clone(), meter)
            attn.n_heads, attn.n_kv = n_kv * per_group, n_kv
            attn.split = (len(q_rows), len(k_rows), len(v_rows))
            m = layer.mlp
            m.gate_up_proj = _column(m.gate_up_proj, torch.cat((gate_rows, cfg.intermediate_size + gate_rows)))
            m.down_proj = RowParallelLinear(m.down_proj.weight.detach()[:, mlp].clone(), meter)
    # model.config stays the full model's (drafters and checks read it); the KV cache follows
    # the attention modules' own head counts (Transformer.new_cache)
    return meter
