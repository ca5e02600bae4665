"""How a driver runs the target's and the drafter's math: eagerly (``EAGER``), or through compiled
graphs (``core.compiled.CompiledRunner``). A driver (``core.batching.BatchEngine``) is given one when it
is built and passes it to every phase; the model and the drafter (``forward``, a static-shape
``step``) never hear of it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from torch import Tensor

from specdecode.core.kvcache import KVCache
from specdecode.core.model import ForwardOutput, Transformer


class AuxLayerConfig(Protocol):
    """The part of a drafter's config the loop reads: which target layers' inputs to tap."""

    @property
    def aux_layer_ids(self) -> tuple[int, ...]: ...


class Drafter(Protocol):
    """What the speculative loop needs of a drafter: ``Eagle3Drafter`` (the EAGLE-3 head) and
    ``SelfDrafter`` (a full model proposing its own tokens) are both one.

    Calling it runs one draft step over ``tokens`` [B, T] paired with ``hidden`` [B, T, ...] at
    ``positions``, appending to ``cache`` (one row), or, with ``slots`` [B, T] and a [B, T, S]
    ``attention_mask``, writing row b's entries at its own slots (a batch of rows of different
    lengths); it returns draft-vocabulary logits [B, T, Vd] and the hidden state the next step
    feeds back. ``to_target_ids`` maps draft ids to target ids.
    """

    @property
    def config(self) -> AuxLayerConfig: ...

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache: ...

    def to_target_ids(self, draft_ids: Tensor) -> Tensor: ...

    def __call__(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
                 attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


class StepRunner(Protocol):
    """Runs the target's and a drafter's forward for a driver; ``capacity`` sizes its caches (a
    compiled runner rounds them to buckets, so one graph serves requests of about one length)."""

    def target(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
               attention_mask: Tensor | None = None, hidden_layers: Sequence[int] = (),
               logits_at: Tensor | None = None, slots: Tensor | None = None) -> ForwardOutput: ...

    def draft(self, drafter: Drafter, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
              attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def capacity(self, max_len: int) -> int: ...


class EagerRunner:
    """Every call is the module's own forward."""

    def target(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
               attention_mask: Tensor | None = None, hidden_layers: Sequence[int] = (),
               logits_at: Tensor | None = None, slots: Tensor | None = None) -> ForwardOutput:
        return model(tokens, positions, cache, attention_mask, hidden_layers, logits_at, slots)

    def draft(self, drafter: Drafter, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
              attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return drafter(tokens, hidden, positions, cache, attention_mask, slots)

    def capacity(self, max_len: int) -> int:
        return max_len


EAGER = EagerRunner()


class MeteredRunner:
    """``inner``'s calls timed: the seconds spent inside them and how many, so that a cycle's host work
    (everything else: Python, masks and lists turned into tensors, top-k outside a graph) is its time less
    these (``core.speculative.spec_cycle``). ``wait``: what makes a call's time its own (CUDA: a device
    synchronize; nothing on a CPU, where a call returns when its work is done)."""

    def __init__(self, inner: StepRunner, wait: Callable[[], None] | None = None) -> None:
        self.inner, self.wait = inner, wait
        self.seconds, self.calls = 0.0, 0

    def _timed(self, t0: float) -> None:
        if self.wait is not None:
            self.wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    def target(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
               attention_mask: Tensor | None = None, hidden_layers: Sequence[int] = (),
               logits_at: Tensor | None = None, slots: Tensor | None = None) -> ForwardOutput:
        if self.wait is not None:
            self.wait()
        t0 = time.perf_counter()
        out = self.inner.target(model, tokens, positions, cache, attention_mask, hidden_layers, logits_at, slots)
        self._timed(t0)
        return out

    def draft(self, drafter: Drafter, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
              attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.wait is not None:
            self.wait()
        t0 = time.perf_counter()
        out = self.inner.draft(drafter, tokens, hidden, positions, cache, attention_mask, slots)
        self._timed(t0)
        return out

    def capacity(self, max_len: int) -> int:
        return self.inner.capacity(max_len)
