"""The KV cache: preallocated keys and values per layer, with rollback (``truncate``) and
compaction (``keep``) for speculative decoding, row views for continuous batching."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys/values: per layer one [B, kv_heads, max_len + 1, head_dim] tensor;
    ``length`` slots are valid.

    New tokens are appended at ``length``; ``truncate`` rolls back and ``keep`` compacts chosen
    slots (the accepted path of a draft tree) into a contiguous run. Slot ``max_len`` (the last)
    is scratch: padding tokens of a bucketed step (``core.compiled``) write there, nothing reads it.
    One tensor per layer, not one for all: a compiled step mutates each in place, while views of
    one storage made inductor copy the whole cache around every step (measured: 28 ms vs 15 ms
    per q4 decode step, SmolLM2, 2 threads).
    """

    def __init__(self, k: list[Tensor], v: list[Tensor], length: int = 0,
                 parent: KVCache | None = None, row0: int = 0) -> None:
        self.k, self.v = k, v
        self.max_len = k[0].shape[2] - 1 if k else 0
        self.length = length
        self.parent, self.row0 = parent, row0  # rows(): the pool these rows belong to, and where

    @classmethod
    def allocate(cls, layers: int, batch_size: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (batch_size, kv_heads, max_len + 1, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def rows(self, start: int, stop: int, length: int = 0) -> KVCache:
        """Rows ``[start, stop)`` of this cache as a cache of their own (shared storage: writes go
        into this one). Continuous batching gives each request such a view."""
        root, offset = (self.parent, self.row0) if self.parent is not None else (self, 0)
        return KVCache([k[start:stop] for k in self.k], [v[start:stop] for v in self.v], length,
                       root, offset + start)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, slots: Tensor) -> None:
        """Move cache slots ``slots`` (absolute, ascending) to ``start, start+1, ...``
        and set the length to ``start + len(slots)``. Everything after is discarded."""
        self._move(slice(None), start, slots)
        self.length = start + slots.numel()

    def keep_row(self, row: int, start: int, slots: Tensor) -> None:
        """``keep`` for one row of a pool (its length is the caller's, as rows' lengths are):
        slots ``slots`` of that row moved to ``start, start+1, ...``."""
        self._move(row, start, slots)

    def _move(self, rows: int | slice, start: int, slots: Tensor) -> None:
        n = slots.numel()
        if n and not torch.equal(slots, torch.arange(start, start + n, device=slots.device)):
            for t in (*self.k, *self.v):
                t[rows, :, start:start + n] = t[rows, :, slots]

    def copy_row(self, src: int, dst: int, used: int) -> None:
        """Row ``src``'s first ``used`` slots into row ``dst``."""
        if used:
            for t in (*self.k, *self.v):
                t[dst, :, :used] = t[src, :, :used]

    def swap_rows(self, i: int, j: int, used_i: int, used_j: int) -> None:
        """Exchange rows i and j (their first ``used_*`` slots)."""
        for t in (*self.k, *self.v):
            keep = t[i, :, :used_i].clone()
            if used_j:
                t[i, :, :used_j] = t[j, :, :used_j]
            t[j, :, :used_i] = keep
