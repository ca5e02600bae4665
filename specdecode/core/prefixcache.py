"""The prefix cache: prompt KV kept after a request's prefill, so a later prompt that starts the
same way (a system prompt, a few-shot preamble, the same question asked again) copies those
positions in instead of computing them.

Blocks of ``BLOCK`` tokens form a tree: a block's key is (its parent block, its tokens), so a
block is found only after every block before it, and two prompts share exactly the blocks they
share from the start (no hash collisions: the tokens themselves are the key, as in SGLang's radix
tree; vLLM hashes them). Each block holds every layer's keys and values for its positions and,
when the engine drafts, the target's taps there (``SpecRow.pending_hidden``): the drafter then
reads a cached prompt whole, as it would after a full prefill. The least recently used block
without children is evicted first, so a shared stem outlives the branches that hang from it.

More in docs/serving.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.core.kvcache import KVCache

BLOCK = 16  # tokens per block: vLLM's default; small enough that most of a shared prefix is reused

_ROOT = -1  # the parent of a prompt's first block


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hit_tokens: int = 0  # prompt tokens copied in instead of computed
    stored_blocks: int = 0  # blocks written (evictions included)
    evicted_blocks: int = 0


class PrefixCache:
    """Up to ``tokens`` prompt positions (rounded down to whole blocks) of keys and values shaped
    like the rows of ``like`` (a KV pool: one tensor per layer, [rows, kv_heads, slots, head_dim]),
    on its device and in its dtype, and ``taps`` values per position (the target's taps a drafter
    reads: 0 when none). Everything is allocated here, so that a cache too large for the device fails
    at startup, not in a request. Not thread-safe: the engine's thread owns it."""

    def __init__(self, tokens: int, like: KVCache, block: int = BLOCK, aligned: int = 1, taps: int = 0) -> None:
        if tokens < block:
            raise ValueError(f"a prefix cache of {tokens} tokens holds no block of {block}; use at least {block} "
                             f"(or 0 to turn it off)")
        self.block = block
        self.align = math.lcm(block, max(1, aligned))  # hit lengths are multiples of this
        self.capacity = tokens // block
        self.k = [self._blocks_like(t) for t in like.k]
        self.v = [self._blocks_like(t) for t in like.v]
        k0 = like.k[0]
        self.taps = (torch.empty(self.capacity, block, taps, dtype=k0.dtype, device=k0.device)
                     if taps else None)  # [capacity, block, width]
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent slot, tokens) -> slot
        self._key: list[tuple[int, tuple[int, ...]] | None] = [None] * self.capacity
        self._children = [0] * self.capacity
        self._lru: OrderedDict[int, None] = OrderedDict()  # used slots, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self.stats = PrefixStats()

    def _blocks_like(self, t: Tensor) -> Tensor:
        _, heads, _, dim = t.shape
        # empty, not zeros: nothing is read before it is written, and on CPU untouched pages cost no memory
        return torch.empty(self.capacity, heads, self.block, dim, dtype=t.dtype, device=t.device)

    @property
    def nbytes(self) -> int:
        taps = () if self.taps is None else (self.taps,)
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *taps))

    @property
    def used_blocks(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        """Forget every block (and the counts)."""
        self.stats = PrefixStats()
        self._index.clear()
        self._key = [None] * self.capacity
        self._children = [0] * self.capacity
        self._lru.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    # ------------------------------------------------------------ lookup

    def match(self, prompt: Sequence[int]) -> list[int]:
        """The slots of the longest stored prefix of ``prompt`` that leaves at least one token to
        compute, its length a multiple of the alignment; they become the most recently used."""
        self.stats.lookups += 1
        B, slots, parent = self.block, [], _ROOT
        for start in range(0, len(prompt) - 1 - B + 1, B):  # a block ending before the prompt's last token
            slot = self._index.get((parent, tuple(prompt[start:start + B])))
            if slot is None:
                break
            slots.append(slot)
            parent = slot
        del slots[len(slots) * B // self.align * self.align // B:]
        for slot in reversed(slots):  # the stem most recent: leaves go first
            self._lru.move_to_end(slot)
        return slots

    def load(self, slots: list[int], cache: KVCache, row: int) -> Tensor | None:
        """Copy blocks ``slots`` into positions [0, len(slots) * block) of ``cache``'s row ``row``;
        returns their taps ([positions, width]) when stored with taps."""
        if not slots:
            return None
        n, B = len(slots), self.block
        index = torch.tensor(slots, device=self.k[0].device)
        for store, pool in zip((*self.k, *self.v), (*cache.k, *cache.v), strict=True):
            blocks = store.index_select(0, index)  # [n, heads, B, dim]
            pool[row, :, :n * B] = blocks.transpose(0, 1).reshape(blocks.shape[1], n * B, blocks.shape[3])
        self.stats.hit_tokens += n * B
        return None if self.taps is None else self.taps.index_select(0, index).reshape(n * B, -1)

    # ------------------------------------------------------------ storing

    def save(self, prompt: Sequence[int], cache: KVCache, row: int, taps: Tensor | None = None) -> int:
        """Store the full blocks of ``prompt`` (its keys and values at positions [0, len(prompt)) of
        ``cache``'s row ``row``; ``taps``: the target's taps there, [len(prompt), width]) that are
        not stored yet, evicting least recently used leaves to make room. Returns blocks stored."""
        B, parent, new = self.block, _ROOT, []
        first = None  # the first block not stored: it and every one after it are new
        path: list[int] = []
        for k in range(len(prompt) // B):
            key = (parent, tuple(prompt[k * B:(k + 1) * B]))
            slot = self._index.get(key)
            if slot is None:
                slot = self._take(protect=parent)
                if slot is None:
                    break  # full of blocks in use by this prompt's path: the rest is not stored
                first = k if first is None else first
                self._index[key], self._key[slot] = slot, key
                if parent != _ROOT:
                    self._children[parent] += 1
                new.append(slot)
            path.append(slot)
            parent = slot
        for slot in reversed(path):
            self._lru[slot] = None
            self._lru.move_to_end(slot)
        if not new:
            return 0
        assert first is not None
        n, index = len(new), torch.tensor(new, device=self.k[0].device)
        span = slice(first * B, (first + n) * B)
        for store, pool in zip((*self.k, *self.v), (*cache.k, *cache.v), strict=True):
            heads, dim = pool.shape[1], pool.shape[3]
            store.index_copy_(0, index, pool[row, :, span].reshape(heads, n, B, dim).transpose(0, 1))
        if taps is not None:
            if self.taps is None:
                raise ValueError("this prefix cache holds no taps: make it with taps=<width>")
            self.taps.index_copy_(0, index, taps[span].reshape(n, B, -1).to(self.taps.dtype))
        self.stats.stored_blocks += n
        return n

    def _take(self, protect: int) -> int | None:
        """A slot for a new block: a free one, else the least recently used leaf (not ``protect``,
        the parent the new block hangs from)."""
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            if self._children[slot] == 0 and slot != protect:
                break
        else:
            return None
        key = self._key[slot]
        assert key is not None
        del self._index[key], self._lru[slot]
        if key[0] != _ROOT:
            self._children[key[0]] -= 1
        self._key[slot] = None
        self.stats.evicted_blocks += 1
        return slot
