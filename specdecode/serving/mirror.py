"""`serve --tp N`: rank 0 receives requests; the other ranks mirror each job in lockstep."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class MirroredEngine:
    """Rank 0's engine under tensor parallelism when requests arrive on rank 0 only (`serve`):
    each job is broadcast to the other ranks, which run the same stream in lockstep; before
    every step rank 0 broadcasts whether to go on, so a job stopped early (a client that
    went away) stops on every rank instead of leaving them waiting in an all-reduce."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stream(self, prompt_ids, options, profile=None):
        options = pin_seed(options)  # every rank must draw the same samples
        dist.broadcast_object_list([{"op": "job", "prompt_ids": list(prompt_ids), "options": options}], src=0)
        steps = self.engine.stream(prompt_ids, options, profile)
        try:
            while True:
                _broadcast_flag(1)
                try:
                    chunk = next(steps)
                except StopIteration:
                    return
                yield chunk
        finally:
            _broadcast_flag(0)
            steps.close()

    def shutdown(self) -> None:
        dist.broadcast_object_list([{"op": "shutdown"}], src=0)


def pin_seed(options):
    """Sampling without a seed gets one (chosen here, on rank 0), so it can be shared."""
    import random
    from dataclasses import replace as dc_replace

    if options.sampling.greedy or options.sampling.seed is not None:
        return options
    return dc_replace(options, sampling=dc_replace(options.sampling, seed=random.randrange(2**63)))


def _broadcast_flag(value: int) -> int:
    flag = torch.tensor([value], dtype=torch.int32)
    dist.broadcast(flag, src=0)
    return int(flag)


def follow(engine) -> None:
    """Ranks > 0 of `serve --tp N`: run the jobs rank 0 broadcasts until it shuts down."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0]["op"] != "job":
            return
        steps = engine.stream(message[0]["prompt_ids"], message[0]["options"])
        try:
            while _broadcast_flag(0) == 1:
                next(steps, None)  # rank 0 saw the same chunk (or the same end)
        finally:
            steps.close()
