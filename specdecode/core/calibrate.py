"""Measuring what a speculative cycle costs on this machine (``core.costmodel.CycleCosts``): a
plain decode step, each candidate shape's draft, verify and bookkeeping phases from real cycles
of the loop, and the draft re-extend by tokens accepted. ``runtime.autospec`` caches the result."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from specdecode.core.costmodel import CycleCosts, ShapeCost, shape_key
from specdecode.core.engine import BaselineDecoder, Engine
from specdecode.core.model import Transformer
from specdecode.core.profiler import CycleRecord
from specdecode.core.requests import GenerateOptions, TokenIdsOnly
from specdecode.core.runner import EAGER, Drafter, StepRunner
from specdecode.core.speculative import Eagle3Decoder, SpecConfig, extend_draft

BASELINE_EVERY = 4  # shapes measured between two segments of plain steps
BASELINE_STEPS = 6  # timed plain steps a segment


def _median_ms(values: Sequence[float]) -> float:
    return 1000 * statistics.median(values)


def baseline_step_times(target: Transformer, prompt_ids: Sequence[int], steps: int, warmup: int = 2,
                        runner: StepRunner = EAGER) -> list[float]:
    """Seconds between plain decode steps (the prefill and ``warmup`` steps excluded)."""
    times, last = [], 0.0
    options = GenerateOptions(max_new_tokens=steps + warmup + 1, stop_token_ids=())
    for i, _ in enumerate(Engine(target, TokenIdsOnly(()), BaselineDecoder(runner=runner)).stream(prompt_ids,
                                                                                                   options)):
        synchronize(target.device)  # the token is read on the host anyway; a no-op on CPU
        now = time.perf_counter()
        if i > warmup:
            times.append(now - last)
        last = now
    return times


def shape_cycles(target: Transformer, drafter: Drafter, shape: SpecConfig, prompt_ids: Sequence[int],
                 cycles: int, warmup: int = 1, runner: StepRunner = EAGER) -> list[CycleRecord]:
    """``cycles`` real cycles of ``shape`` (greedy) after ``warmup``, each with its phase times and ``wall``,
    the loop's whole step around it."""
    options = GenerateOptions(max_new_tokens=(cycles + warmup + 1) * (shape.max_depth + 1) + 1, stop_token_ids=())
    decoder = Eagle3Decoder(drafter, shape, runner=runner)
    batch = Engine(target, TokenIdsOnly(()), decoder).batch_for(len(prompt_ids), options)
    with torch.inference_mode():  # as Engine.stream
        batch.add(0, prompt_ids, options)
    batch.step(decode=False)
    records = []
    for _ in range(cycles + warmup):
        t0 = time.perf_counter()
        report = batch.step()
        synchronize(target.device)
        wall = time.perf_counter() - t0  # the whole step as the loop pays it: the cycle, text, stop checks
        records += [replace(r, times={**r.times, "wall": wall}) for r in report.cycle_records()]
    records = records[warmup:]
    if not records:
        raise RuntimeError(f"no speculative cycle ran for shape {shape_key(shape)}")
    return records


@torch.inference_mode()
def extend_ms(target: Transformer, drafter: Drafter, prompt_ids: Sequence[int], tokens: Sequence[int],
              repeats: int, runner: StepRunner = EAGER) -> dict[int, float]:
    """Median ms of the draft re-extend over T pairs after the prompt's, per T: the pairs are the
    target's own taps over the prompt (its dtype, its device) with the prompt's next tokens."""
    device, n = target.device, len(prompt_ids)
    if n <= max(tokens):
        raise ValueError(f"the calibration prompt ({n} tokens) must be longer than the re-extend ({max(tokens)})")
    ids = torch.tensor(prompt_ids, device=device)
    out = runner.target(target, ids.view(1, -1), torch.arange(n, device=device), target.new_cache(1, n),
                        hidden_layers=drafter.config.aux_layer_ids)
    taps = torch.cat(out.hidden_states, -1)[0]
    cache = drafter.new_cache(runner.capacity(n + max(tokens) + 1))
    context = n - max(tokens) - 1
    extend_draft(drafter, cache, taps[:context], ids[1:context + 1], 0, runner)
    times: dict[int, float] = {}
    for t in tokens:
        samples = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache.truncate(context)
            synchronize(device)
            t0 = time.perf_counter()
            extend_draft(drafter, cache, taps[context:context + t], ids[context + 1:context + 1 + t], context, runner)
            synchronize(device)
            samples.append(time.perf_counter() - t0)
        times[t] = _median_ms(samples[1:])
    return times


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_cycle_costs(target: Transformer, drafter: Drafter, shapes: Sequence[SpecConfig],
                        prompt_ids: Sequence[int], cycles: int = 4, rounds: int = 2,
                        on_shape: Callable[[str], None] | None = None, runner: StepRunner = EAGER) -> CycleCosts:
    """Every cost the cost model needs for ``shapes`` on this target and drafter, as decoding
    runs them (the same loop, cache and kernels), after ``prompt_ids``: per shape, the medians of
    ``cycles`` cycles in each of ``rounds`` rounds (after one warm-up each), and the plain steps
    timed beside it.

    The machine's speed drifts while it calibrates (a 2-core EPYC's plain step read a third slower beside
    the first shapes than beside the last: docs/LOG.md), so in one round in candidate order every chain
    would be measured on a slower machine than every top-4 tree.
    The rounds alternate the order (the second runs the shapes backwards), so a steady drift reaches
    every shape alike, and each shape keeps the plain steps timed on either side of it in each
    round (``ShapeCost.baseline_ms``), by which the cost model puts all shapes on one time base.
    2 rounds of 4 cycles: 8 cycles a shape, against 6 in one round before."""
    segments: list[list[float]] = []
    records: dict[str, list[CycleRecord]] = {}
    near: dict[str, list[float]] = {}
    for r in range(rounds):
        order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
        before = baseline_step_times(target, prompt_ids, steps=BASELINE_STEPS, runner=runner)
        segments.append(before)
        for g in range(0, len(order), BASELINE_EVERY):
            group = order[g:g + BASELINE_EVERY]
            for shape in group:
                if on_shape:
                    on_shape(shape_key(shape))
                records.setdefault(shape_key(shape), []).extend(shape_cycles(target, drafter, shape, prompt_ids,
                                                                             cycles, runner=runner))
            after = baseline_step_times(target, prompt_ids, steps=BASELINE_STEPS, runner=runner)
            segments.append(after)
            for shape in group:
                near.setdefault(shape_key(shape), []).extend(before + after)
            before = after
    costs = {}
    for shape in shapes:
        rs = records[shape_key(shape)]
        draft, verify, other = (_median_ms([r.times.get(p, 0.0) for r in rs]) for p in ("draft", "verify", "other"))
        loop = _median_ms([max(0.0, r.times["wall"] - r.times["total"]) for r in rs])
        costs[shape_key(shape)] = ShapeCost(draft, verify, other, _median_ms(near[shape_key(shape)]), loop)
    deepest = max(s.max_depth for s in shapes) + 1
    isolated = extend_ms(target, drafter, prompt_ids, range(1, deepest + 1), 2 * cycles, runner)
    return CycleCosts(_median_ms([t for seg in segments for t in seg]), costs,
                      in_loop_extend(isolated, [r for rs in records.values() for r in rs]))


def in_loop_extend(isolated: dict[int, float], records: Sequence[CycleRecord], least: int = 3) -> dict[int, float]:
    """The re-extend's cost by tokens as the loop pays it: the cycles' own extend phase (T = accepted
    + 1 tokens) where at least ``least`` cycles had that T, else the isolated timing plus the median
    gap between the two: in the loop it costs about twice the isolated timing (after the target's verify
    the draft's weights are no longer in cache; docs/LOG.md)."""
    by: dict[int, list[float]] = {}
    for r in records:
        by.setdefault(r.accepted + 1, []).append(r.times.get("extend", 0.0))
    loop = {t: _median_ms(v) for t, v in by.items() if len(v) >= least and t in isolated}
    gap = statistics.median([loop[t] - isolated[t] for t in loop]) if loop else 0.0
    return {t: loop.get(t, ms + gap) for t, ms in isolated.items()}
