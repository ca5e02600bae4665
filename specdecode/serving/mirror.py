"""`serve --tp N`: rank 0 receives requests; every rank runs the same batch engine, in lockstep.

Rank 0 broadcasts each operation on its batch (a request added or removed, a step) before doing
it, and the other ranks (``follow``) do the same operation on theirs: the same batch, the same
shapes, the same all-reduces. A request's key stays on rank 0; the others know it by a number."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from specdecode.core.batching import BatchEngine, Finished, StepReport
from specdecode.core.requests import GenerateOptions


class MirroredBatcher:
    """Rank 0's batch engine under tensor parallelism (a ``serving.scheduler.Batcher``)."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self._ids: dict[Hashable, int] = {}
        self._next = 0

    @property
    def active(self) -> int:
        return self.engine.active

    @property
    def free_slots(self) -> int:
        return self.engine.free_slots

    def allocate(self) -> None:
        self.engine.allocate()

    def add(self, key: Hashable, prompt_ids: Sequence[int], options: GenerateOptions) -> int:
        options = pin_seed(options)  # every rank must draw the same samples
        self.engine.check(len(prompt_ids), options)  # refused here, before the other ranks hear of it
        self._ids[key], self._next = self._next, self._next + 1
        _send({"op": "add", "key": self._ids[key], "prompt_ids": list(prompt_ids), "options": options})
        return self.engine.add(key, prompt_ids, options)

    def remove(self, key: Hashable) -> Finished | None:
        if key not in self._ids:
            return None
        _send({"op": "remove", "key": self._ids.pop(key)})
        return self.engine.remove(key)

    def step(self) -> StepReport:
        _send({"op": "step"})
        report = self.engine.step()
        for done in report.finished:
            self._ids.pop(done.key, None)
        return report

    def shutdown(self) -> None:
        _send({"op": "shutdown"})


def pin_seed(options: GenerateOptions) -> GenerateOptions:
    """Sampling without a seed gets one (chosen here, on rank 0), so it can be shared."""
    if options.sampling.greedy or options.sampling.seed is not None:
        return options
    return replace(options, sampling=replace(options.sampling, seed=random.randrange(2**63)))


def _send(message: dict[str, Any]) -> None:
    dist.broadcast_object_list([message], src=0)


def follow(engine: BatchEngine) -> None:
    """Ranks > 0 of `serve --tp N`: do what rank 0 broadcasts, on ``engine``, until it shuts down."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message["op"] == "add":
            engine.add(message["key"], message["prompt_ids"], message["options"])
        elif message["op"] == "remove":
            engine.remove(message["key"])
        elif message["op"] == "step":
            engine.step()
        else:
            return
