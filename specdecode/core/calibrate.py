"""Measuring what a speculative cycle costs on this machine (``core.costmodel.CycleCosts``): a
plain decode step, each candidate shape's draft, verify and bookkeeping phases from real cycles
of the loop, and the draft re-extend by tokens accepted. ``runtime.autospec`` caches the result."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from itertools import islice

import torch

from specdecode.core.costmodel import CycleCosts, ShapeCost, shape_key
from specdecode.core.engine import baseline_decode
from specdecode.core.model import Transformer
from specdecode.core.sampling import SamplingParams
from specdecode.core.speculative import Drafter, SpecConfig, eagle3_decode, extend_draft


def _median_ms(values: Sequence[float]) -> float:
    return 1000 * statistics.median(values)


def baseline_step_ms(target: Transformer, prompt_ids: Sequence[int], steps: int, warmup: int = 2) -> float:
    """Median ms between plain decode steps (the prefill excluded)."""
    times, last = [], 0.0
    for i, _ in enumerate(baseline_decode(target, prompt_ids, steps + warmup + 1, SamplingParams())):
        now = time.perf_counter()
        if i > warmup:
            times.append(now - last)
        last = now
    return _median_ms(times)


def shape_cost(target: Transformer, drafter: Drafter, shape: SpecConfig, prompt_ids: Sequence[int],
               cycles: int, warmup: int = 2) -> ShapeCost:
    """Median phase times over ``cycles`` real cycles of ``shape`` (greedy) after ``warmup``."""
    budget = (cycles + warmup + 1) * (shape.max_depth + 1) + 1
    steps = eagle3_decode(target, drafter, prompt_ids, budget, SamplingParams(), None, shape)
    records = [s.cycle for s in islice(steps, 1, cycles + warmup + 1) if s.cycle is not None][warmup:]
    if not records:
        raise RuntimeError(f"no speculative cycle ran for shape {shape_key(shape)}")
    return ShapeCost(*(_median_ms([r.times.get(p, 0.0) for r in records]) for p in ("draft", "verify", "other")))


@torch.inference_mode()
def extend_ms(drafter: Drafter, hidden_size: int, context: int, tokens: Sequence[int], repeats: int,
              device: torch.device) -> dict[int, float]:
    """Median ms of the draft re-extend over T pairs after ``context`` cached ones, per T."""
    cache = drafter.new_cache(context + max(tokens) + 1)
    n_aux = len(drafter.config.aux_layer_ids)
    extend_draft(drafter, cache, torch.randn(context, n_aux * hidden_size, device=device),
                 torch.randint(0, 1000, (context,), device=device), 0)
    out = {}
    for t in tokens:
        hidden = torch.randn(t, n_aux * hidden_size, device=device)
        ids = torch.randint(0, 1000, (t,), device=device)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache.truncate(context)
            t0 = time.perf_counter()
            extend_draft(drafter, cache, hidden, ids, context)
            times.append(time.perf_counter() - t0)
        out[t] = _median_ms(times[1:])
    return out


def measure_cycle_costs(target: Transformer, drafter: Drafter, shapes: Sequence[SpecConfig],
                        prompt_ids: Sequence[int], cycles: int = 10,
                        on_shape: Callable[[str], None] | None = None) -> CycleCosts:
    """Every cost the cost model needs for ``shapes`` on this target and drafter, as decoding
    runs them (the same loop, cache and kernels), after ``prompt_ids``."""
    base = baseline_step_ms(target, prompt_ids, steps=2 * cycles)
    costs = {}
    for shape in shapes:
        if on_shape:
            on_shape(shape_key(shape))
        costs[shape_key(shape)] = shape_cost(target, drafter, shape, prompt_ids, cycles)
    deepest = max(s.max_depth for s in shapes) + 1
    ext = extend_ms(drafter, target.config.hidden_size, len(prompt_ids), range(1, deepest + 1), cycles,
                    target.device)
    return CycleCosts(base, costs, ext)
