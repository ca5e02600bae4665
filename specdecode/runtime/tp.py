"""Tensor parallelism over torch.distributed, applied to a built model (as gpt-fast does).

Per layer: q/k/v and gate/up are split by output rows (column parallel: each rank owns whole
KV-head groups and a slice of the MLP), o_proj and down_proj by input columns (row
parallel), each followed by one all-reduce. Embedding, norms and lm_head stay replicated,
so every rank computes the same logits and runs the same decode loop (SPMD): the engine,
the sampler and speculative decoding work unchanged, and the drafter runs replicated.

Heads need not divide evenly: SmolLM2 has 3 KV-head groups, so with 2 ranks one owns 2
groups and the other 1 (uneven work, same result).

Launch: ``specdecode generate|bench|sweep|check --tp N`` spawns N local workers (gloo on
CPU, NCCL on CUDA); under ``torchrun`` the process group comes from its environment.
Time inside collectives is measured by a ``CommMeter`` and shown as its own profiler phase.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from specdecode.core.model import Linear, Transformer

WORKER_ENV = "SPECDECODE_TP_WORKER"  # set in spawned workers: do not spawn again


@dataclass
class CommMeter:
    """Cumulative time and traffic of this rank's all-reduces. On CUDA the device is
    synchronized around each call, so the time is the collective's, not its launch."""

    group: object = None
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


def apply_tensor_parallel(model: Transformer, rank: int, world: int, group=None) -> CommMeter:
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


# ---------------------------------------------------------------- process groups

def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    return world()[0] == 0


def init_from_env(device: str = "cpu") -> bool:
    """Join the process group described by torchrun-style variables, if any."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return dist.is_initialized()
    backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    if dist.get_rank() != 0:  # one voice: rank 0 prints and stores results
        devnull = open(os.devnull, "w")
        sys.stdout, sys.stderr = devnull, devnull
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, entry: Callable[[list[str]], int], argv: list[str],
            threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), WORKER_ENV: "1",
                       "SPECDECODE_THREADS": os.environ.get("SPECDECODE_THREADS") or str(threads)})
    code = entry(argv)
    if dist.is_initialized():
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


def spawn(entry: Callable[[list[str]], int], argv: list[str], size: int) -> int:
    """Run ``entry(argv)`` (a picklable, module-level function: the CLI's ``main``) as ``size``
    tensor-parallel workers on this machine; each joins the process group from its environment."""
    import torch.multiprocessing as mp

    from specdecode.runtime.device import available_cores

    threads = max(1, available_cores() // size)  # oversubscribing cores slowed decode 5x here
    ctx = mp.start_processes(_worker, args=(size, free_port(), entry, argv, threads), nprocs=size, join=False,
                             start_method="spawn")
    # SIGTERM goes to rank 0, which ends its work (a server finishes its request) and releases
    # the other ranks; Ctrl-C reaches every worker through the process group anyway.
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(ctx.processes[0].pid, signal.SIGTERM))
    try:
        while not ctx.join():
            pass
    except mp.ProcessRaisedException as e:
        print(f"specdecode: a tensor-parallel worker failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        return e.exit_code or 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
