"""The KV cache: preallocated keys and values per layer, with rollback (``truncate``) and
compaction (``keep``) for speculative decoding, row views for continuous batching."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys/values: per layer one [B, kv_heads, max_len + 1, head_dim] tensor, and
    each row's length (how many of its slots are valid), which the cache alone keeps.

    A call without slots appends at ``length`` (every row's, when all rows have one) and ``advance``s;
    a call with per-row slots writes where it is told and its caller ``advance``s each row by what it
    added. ``truncate`` rolls back and ``keep``/``keep_row`` compact chosen slots (the accepted path of a
    draft tree) into a contiguous run, setting the length. Slot ``max_len`` (the last) is scratch:
    padding tokens of a bucketed step (``core.compiled``) write there, nothing reads it. One tensor per
    layer, not one for all: a compiled step mutates each in place, while views of one storage made
    inductor copy the whole cache around every step (a q4 decode step took nearly twice as long).
    """

    def __init__(self, k: list[Tensor], v: list[Tensor], parent: KVCache | None = None, row0: int = 0) -> None:
        self.k, self.v = k, v
        self.max_len = k[0].shape[2] - 1 if k else 0
        self.parent, self.row0 = parent, row0  # rows(): the pool these rows belong to, and where
        # the pool's lengths, shared by its row views (this cache's rows are [row0, row0 + batch_size))
        self._lengths: list[int] = parent._lengths if parent is not None else [0] * self.batch_size

    @classmethod
    def allocate(cls, layers: int, batch_size: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (batch_size, kv_heads, max_len + 1, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if self.k else 1

    @property
    def lengths(self) -> list[int]:
        """Each row's valid slots (host ints: known without a device sync)."""
        return self._lengths[self.row0:self.row0 + self.batch_size]

    @property
    def length(self) -> int:
        """The rows' one length (a request's own cache, or rows appended together)."""
        lengths = self.lengths
        if any(n != lengths[0] for n in lengths):
            raise ValueError(f"rows of different lengths {lengths}: write them at per-row slots")
        return lengths[0]

    def advance(self, n: int | Sequence[int]) -> None:
        """Count ``n`` more valid slots in every row (a sequence: per row), written past its length."""
        counts = [n] * self.batch_size if isinstance(n, int) else list(n)
        if len(counts) != self.batch_size:
            raise ValueError(f"{len(counts)} counts for {self.batch_size} rows")
        for i, c in enumerate(counts):
            if not 0 <= self._lengths[self.row0 + i] + c <= self.max_len:
                raise ValueError(f"row {i}: {self._lengths[self.row0 + i]} + {c} slots outside the cache "
                                 f"({self.max_len})")
            self._lengths[self.row0 + i] += c

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``[start, stop)`` of this cache as a cache of their own (shared storage and lengths:
        writes go into this one). Continuous batching gives each request such a view."""
        root, offset = (self.parent, self.row0) if self.parent is not None else (self, 0)
        return KVCache([k[start:stop] for k in self.k], [v[start:stop] for v in self.v], root, offset + start)

    def truncate(self, length: int) -> None:
        """Every row back to ``length`` valid slots (at most what it has)."""
        if not all(0 <= length <= n for n in self.lengths):
            raise ValueError(f"cannot truncate a cache of lengths {self.lengths} to {length}")
        for i in range(self.batch_size):
            self._lengths[self.row0 + i] = length

    def keep(self, start: int, slots: Tensor) -> None:
        """Move cache slots ``slots`` (absolute, ascending) to ``start, start+1, ...``
        and set the length to ``start + len(slots)``. Everything after is discarded."""
        self._move(slice(None), start, slots)
        for i in range(self.batch_size):
            self._lengths[self.row0 + i] = start + slots.numel()

    def keep_row(self, row: int, start: int, slots: Tensor) -> None:
        """``keep`` for one row: its slots ``slots`` moved to ``start, start+1, ...``, its length set."""
        self._move(row, start, slots)
        self._lengths[self.row0 + row] = start + slots.numel()

    def _move(self, rows: int | slice, start: int, slots: Tensor) -> None:
        n = slots.numel()
        if n and not torch.equal(slots, torch.arange(start, start + n, device=slots.device)):
            for t in (*self.k, *self.v):
                t[rows, :, start:start + n] = t[rows, :, slots]

    def copy_row(self, src: int, dst: int) -> None:
        """Row ``src`` (its valid slots and length) into row ``dst``."""
        used = self._lengths[self.row0 + src]
        if used:
            for t in (*self.k, *self.v):
                t[dst, :, :used] = t[src, :, :used]
        self._lengths[self.row0 + dst] = used

    def swap_rows(self, i: int, j: int) -> None:
        """Exchange rows i and j (their valid slots and lengths)."""
        used_i, used_j = self._lengths[self.row0 + i], self._lengths[self.row0 + j]
        for t in (*self.k, *self.v):
            keep = t[i, :, :used_i].clone()
            if used_j:
                t[i, :, :used_j] = t[j, :, :used_j]
            t[j, :, :used_i] = keep
        self._lengths[self.row0 + i], self._lengths[self.row0 + j] = used_j, used_i
