"""Tensor parallelism: a facade over ``specdecode.runtime.sharding`` (sharding a built model:
``CommMeter``, ``RowParallelLinear``, ``split_sizes``, ``apply_tensor_parallel``) and
``specdecode.runtime.distributed`` (process groups and workers: ``world``, ``is_main_process``,
``init_from_env``, ``free_port``, ``spawn``, ``WORKER_ENV``).

It only re-exports those names so that code importing ``specdecode.runtime.tp`` keeps working
while imports are repointed to the two modules; new code should import from them directly.
"""

from __future__ import annotations

from specdecode.runtime.distributed import WORKER_ENV, free_port, init_from_env, is_main_process, spawn, world
from specdecode.runtime.sharding import CommMeter, RowParallelLinear, apply_tensor_parallel, split_sizes

__all__ = [
    "WORKER_ENV",
    "CommMeter",
    "RowParallelLinear",
    "apply_tensor_parallel",
    "free_port",
    "init_from_env",
    "is_main_process",
    "spawn",
    "split_sizes",
    "world",
]
