"""The statistics every comparison uses: bootstrap confidence intervals, the sign-flip
(paired) and label-permutation (unpaired) tests, and the geometric mean of speed ratios
with its CI. ``bench``, ``sweep`` and ``compare`` all take them from here."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterable


def sign_flip_p(diffs: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of mean(diffs) != 0 under random sign flips (exact up to 2^16)."""
    n = len(diffs)
    if n == 0:
        return float("nan")
    observed = abs(sum(diffs)) - 1e-12
    if n <= 16:
        flips = itertools.product((1, -1), repeat=n)
        hits = total = 0
        for signs in flips:
            total += 1
            hits += abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= observed
        return hits / total
    rng = random.Random(seed)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed for _ in range(rounds))
    return (hits + 1) / (rounds + 1)


def permutation_p(a: list[float], b: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of mean(b) - mean(a) != 0 under label permutations."""
    if not a or not b:
        return float("nan")
    observed = abs(statistics.fmean(b) - statistics.fmean(a)) - 1e-12
    pooled, n_a = a + b, len(a)
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        hits += abs(statistics.fmean(pooled[n_a:]) - statistics.fmean(pooled[:n_a])) >= observed
    return (hits + 1) / (rounds + 1)


def bootstrap_ci(values: list[float], paired_with: list[float] | None = None, rounds: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """95% CI of exp(mean(values)) (paired log ratios) or exp(mean(values) - mean(paired_with))."""
    rng = random.Random(seed)
    if len(values) < 2 or (paired_with is not None and len(paired_with) < 2):
        return float("nan"), float("nan")
    boots = []
    for _ in range(rounds):
        m = statistics.fmean(rng.choices(values, k=len(values)))
        if paired_with is not None:
            m -= statistics.fmean(rng.choices(paired_with, k=len(paired_with)))
        boots.append(m)
    boots.sort()
    return math.exp(boots[int(0.025 * rounds)]), math.exp(boots[int(0.975 * rounds) - 1])


def geomean_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of speed ratios with its bootstrap 95% CI."""
    logs = [math.log(r) for r in ratios]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    return (math.exp(statistics.fmean(logs)), *bootstrap_ci(logs))


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100), as numpy's default; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

