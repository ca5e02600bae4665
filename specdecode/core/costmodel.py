"""What a speculative shape is predicted to deliver: one formula for the sweep's cost model
(``bench.costmodel``), the automatic choice of a shape (``runtime.autospec``) and its
re-choice while decoding.

A shape drafts ``num_steps`` levels, keeps ``num_draft_tokens`` nodes and verifies them in one
target forward. With ``a_i`` the share of cycles whose accepted path reaches draft position
``i`` (``SpecProfile.per_position_accept``), a cycle emits ``1 + sum(a_1..a_depth)`` tokens
(the bonus token included) and costs its draft steps, its verify forward, the re-extend of
the draft over the accepted tokens, the bookkeeping between and the loop's work around the cycle
(text, stop checks); plain decoding costs one target step per token, as the loop pays it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

from specdecode.core.speculative import SpecConfig, default_draft_tokens, max_draft_tokens

# The shapes ``--spec-config auto`` chooses among: chains of 1-6 steps, top-2 trees of 1-6 and
# top-4 trees of 1-3 steps, each verifying its default node count (SGLang's grid, capped at 16
# tokens verified: on a CPU a verify of 16 tokens already costs 2-3x a decode step).
CANDIDATE_TOPK_STEPS: Mapping[int, tuple[int, ...]] = {1: (1, 2, 3, 4, 5, 6), 2: (1, 2, 3, 4, 5, 6), 4: (1, 2, 3)}


def candidate_shapes(num_draft_tokens: int | None = None) -> list[SpecConfig]:
    """The grid, each shape verifying its default node count, or ``num_draft_tokens`` where given
    (and the tree holds that many)."""
    shapes = []
    for k, steps in CANDIDATE_TOPK_STEPS.items():
        for s in steps:
            n = num_draft_tokens or default_draft_tokens(s, k)
            if 2 <= n <= max_draft_tokens(s, k) and (k > 1 or n == s + 1):
                shapes.append(SpecConfig(s, k, n))
    return shapes


@dataclass(frozen=True)
class AutoSpec:
    """``--spec-config auto``: the shape is chosen by measurement (``runtime.autospec``); a
    field given here is kept and the others are chosen around it. A request no shape can meet
    (``--topk 1 --num-draft-tokens 9`` with ``--num-steps 2``) is refused here, before a model loads."""

    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.static()  # raises if no shape has the fields given

    @property
    def complete(self) -> bool:
        """Steps and top-k given: nothing is left to choose (draft tokens follow ``SpecConfig``'s rule)."""
        return self.num_steps is not None and self.topk is not None

    def static(self) -> SpecConfig:
        """The fields given over the static default ``SpecConfig()``; where that shape cannot verify
        the draft tokens given, the nearest depth (then branching) that can."""
        d = SpecConfig()
        steps = [self.num_steps] if self.num_steps is not None else sorted(
            range(1, 17), key=lambda s: (abs(s - d.num_steps), s))
        topks = [self.topk] if self.topk is not None else [d.topk, 1, 4, 3, *range(5, 9)]
        for k in topks:
            for s in steps:
                try:
                    return SpecConfig(s, k, cast(int, self.num_draft_tokens))
                except ValueError as e:
                    error = e
        if self.num_steps is not None and self.topk is not None:
            raise error
        raise ValueError(f"no draft shape has {self.fields()}: num_draft_tokens must be in [2, "
                         "1 + topk + (num_steps-1)*topk^2] (a chain: num_steps + 1)")

    def admits(self, shape: SpecConfig) -> bool:
        return all(want is None or want == got for want, got in (
            (self.num_steps, shape.num_steps), (self.topk, shape.topk),
            (self.num_draft_tokens, shape.num_draft_tokens)))

    def fields(self) -> dict[str, int]:
        return {k: v for k, v in (("num_steps", self.num_steps), ("topk", self.topk),
                                  ("num_draft_tokens", self.num_draft_tokens)) if v is not None}


def expected_accept_length(per_position_accept: Sequence[float], depth: int) -> float:
    """Tokens per cycle (the bonus token included) of a draft ``depth`` deep."""
    return 1.0 + float(sum(per_position_accept[:depth]))


def predicted_speedup(accept_length: float, cycle_ms: float, baseline_ms_per_token: float) -> float:
    """Speculative tokens per second over plain decoding's."""
    return accept_length * baseline_ms_per_token / cycle_ms if cycle_ms > 0 else float("nan")


@dataclass(frozen=True)
class ShapeCost:
    """Measured ms per cycle of one shape, by phase; re-extend priced separately (it grows
    with the tokens accepted, see ``CycleCosts.extend_ms``)."""

    draft_ms: float
    verify_ms: float
    other_ms: float
    # plain decoding's step timed next to this shape (the machine's speed drifts while it calibrates): how its
    # figures are put on the common time base (``CycleCosts.on_common_base``); None: at ``CycleCosts.baseline_ms``
    baseline_ms: float | None = None
    # the loop's time a cycle outside its phases (text, stop checks, the step around the cycle), which the plain
    # step's time includes: left out, auto overpredicted every shape (benchmarks/results/2026-12-07-cycle/)
    loop_ms: float = 0.0


@dataclass(frozen=True)
class CycleCosts:
    """What ``runtime.autospec`` measures once per machine, model, format, drafter and threads."""

    baseline_ms: float  # one plain decode step (greedy, as the engine runs it)
    shapes: Mapping[str, ShapeCost]  # by shape_key
    extend_ms_by_tokens: Mapping[int, float]  # draft re-extend over T (target hidden, token) pairs

    def shape_cost(self, shape: SpecConfig) -> ShapeCost | None:
        """What a cycle of ``shape`` costs by phase, on the common time base (``on_common_base``: the
        plain step is ``baseline_ms``), read from fits over every measured shape rather than from the
        shape's own figures: the verify by node count (``verify_ms_by_tokens``), the draft by depth for
        its top-k (``draft_ms_by_steps``); bookkeeping is the shape's own (or, for a node count not
        measured, the same depth and top-k's).

        Each shape's figures are medians of a few cycles (8 in ``core.calibrate``) and one reading can be far
        off (a chain of 2 once verified its 3 tokens faster than one plain step, and was predicted well above
        what Spec-Bench then measured: docs/LOG.md, drafter v4), so the fits over every shape are read."""
        base = self.shapes.get(shape_key(shape)) or self.shapes.get(shape_key(SpecConfig(shape.num_steps, shape.topk)))
        if base is None:
            return None
        draft = self.draft_fit.get(shape.topk, {}).get(shape.num_steps, self.on_common_base(base, base.draft_ms))
        return ShapeCost(draft, _interpolate(self.verify_fit, shape.num_draft_tokens),
                         self.on_common_base(base, base.other_ms), self.baseline_ms,
                         self.on_common_base(base, base.loop_ms))

    def on_common_base(self, cost: ShapeCost, ms: float) -> float:
        """``ms`` measured beside ``cost``'s own plain steps, as it reads where a plain step takes
        ``baseline_ms``: the machine's speed drifts between shapes, and a fit that pools shapes measured
        at different speeds must not rank them by when they were measured (pooled raw, the chains, timed
        first on a slower machine, were read against the trees' verifies and overpredicted: docs/LOG.md,
        drafter v5)."""
        return ms * self.baseline_ms / cost.baseline_ms if cost.baseline_ms else ms

    def verify_ms_by_tokens(self) -> dict[int, float]:
        """Verify cost by node count on the common time base: every shape verifying that many pooled (a
        verify's cost is a function of its node count, whatever the tree), then made non-decreasing
        (``monotone_fit``)."""
        by: dict[int, list[float]] = {}
        for key, c in self.shapes.items():
            by.setdefault(int(key.split("/")[2]), []).append(self.on_common_base(c, c.verify_ms))
        return monotone_fit(by)

    @cached_property
    def verify_fit(self) -> dict[int, float]:
        return self.verify_ms_by_tokens()  # read at every prediction (--adapt predicts every 8 cycles)

    @cached_property
    def draft_fit(self) -> dict[int, dict[int, float]]:
        return self.draft_ms_by_steps()

    def draft_ms_by_steps(self) -> dict[int, dict[int, float]]:
        """Draft cost by top-k, then by depth, on the common time base, made non-decreasing in the depth
        (one more step is never free)."""
        by: dict[int, dict[int, list[float]]] = {}
        for key, c in self.shapes.items():
            steps, topk, _ = (int(x) for x in key.split("/"))
            by.setdefault(topk, {}).setdefault(steps, []).append(self.on_common_base(c, c.draft_ms))
        return {k: monotone_fit(v) for k, v in by.items()}

    def verify_ms(self, tokens: int) -> float:
        """A verify of ``tokens`` a row on the common time base (one token: a plain step)."""
        return self.baseline_ms if tokens <= 1 else _interpolate(self.verify_fit, tokens)

    def extend_ms(self, tokens: float) -> float:
        """Linear interpolation (and extrapolation from the last two) over the measured counts."""
        return _interpolate(self.extend_ms_by_tokens, tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"baseline_ms": self.baseline_ms,
                "shapes": {k: {"draft_ms": c.draft_ms, "verify_ms": c.verify_ms, "other_ms": c.other_ms,
                               "baseline_ms": c.baseline_ms, "loop_ms": c.loop_ms} for k, c in self.shapes.items()},
                "extend_ms_by_tokens": {str(k): v for k, v in self.extend_ms_by_tokens.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CycleCosts:
        return cls(float(d["baseline_ms"]), {k: ShapeCost(**v) for k, v in d["shapes"].items()},
                   {int(k): float(v) for k, v in d["extend_ms_by_tokens"].items()})


def monotone_fit(samples: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """A non-decreasing cost by key: each key's median (one outlier among its samples does not move it),
    then the weighted least-squares non-decreasing fit through them (pool-adjacent-violators, each
    key weighted by its sample count): where one key reads below a cheaper one, the two are pooled."""
    blocks: list[list[float]] = []  # [weighted sum, weight, first key index, last key index]
    keys = sorted(k for k in samples if samples[k])
    for i, k in enumerate(keys):
        w = float(len(samples[k]))
        blocks.append([statistics.median(samples[k]) * w, w, i, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1][0] += last[0]
            blocks[-1][1] += last[1]
            blocks[-1][3] = last[3]
    return {keys[i]: b[0] / b[1] for b in blocks for i in range(int(b[2]), int(b[3]) + 1)}


def _interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise linear through ``points`` (extrapolated from the nearest two at either end)."""
    pts = sorted(points.items())
    if not pts:
        raise ValueError("nothing measured to interpolate")
    if len(pts) == 1:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1 or (x1, y1) == pts[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def shape_key(shape: SpecConfig) -> str:
    return f"{shape.num_steps}/{shape.topk}/{shape.num_draft_tokens}"


@dataclass(frozen=True)
class AcceptanceTable:
    """Per-position acceptance of a drafter by branching factor, measured by the engine on
    held-out answers with the deepest candidate shape of each top-k (``eval-drafter
    --acceptance-table``). A shallower shape of the same top-k reads its prefix: for chains
    that is exact, for trees an approximation (a shallower tree keeps other nodes)."""

    per_position: Mapping[int, Sequence[float]]  # topk -> a_1..a_depth
    source: str = ""  # where it came from, in words
    measured_dtype: str | None = None  # the format it was measured in
    measured_weights: str | None = None

    def covers(self, shape: SpecConfig) -> bool:
        return shape.topk in self.per_position and shape.max_depth <= len(self.per_position[shape.topk])

    def accept_length(self, shape: SpecConfig) -> float:
        return expected_accept_length(self.per_position[shape.topk], shape.max_depth)

    def rescaled(self, factor: Mapping[int, float]) -> AcceptanceTable:
        """Every position's acceptance times ``factor[topk]`` (1 where absent), capped at 1 and
        kept non-increasing: what a request's own cycles say of its domain (``adapted``)."""
        out = {}
        for k, pp in self.per_position.items():
            f, prev, row = factor.get(k, 1.0), 1.0, []
            for a in pp:
                prev = min(prev, a * f, 1.0)
                row.append(prev)
            out[k] = row
        return AcceptanceTable(out, self.source, self.measured_dtype, self.measured_weights)


@dataclass
class Prediction:
    shape: SpecConfig
    accept_length: float
    cycle_ms: float
    tok_per_s: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {"num_steps": self.shape.num_steps, "topk": self.shape.topk,
                "num_draft_tokens": self.shape.num_draft_tokens, "accept_length": round(self.accept_length, 4),
                "cycle_ms": round(self.cycle_ms, 4), "tok_per_s": round(self.tok_per_s, 2),
                "speedup": round(self.speedup, 4)}


def predict(shape: SpecConfig, acceptance: AcceptanceTable, costs: CycleCosts) -> Prediction | None:
    """The shape's predicted speed, or None where acceptance or costs were not measured for it."""
    cost = costs.shape_cost(shape)
    if cost is None or not acceptance.covers(shape):
        return None
    length = acceptance.accept_length(shape)
    cycle = cost.draft_ms + cost.verify_ms + cost.other_ms + costs.extend_ms(length) + cost.loop_ms
    base = cost.baseline_ms or costs.baseline_ms
    return Prediction(shape, length, cycle, 1000 * length / cycle, predicted_speedup(length, cycle, base))


def best_shape(shapes: Iterable[SpecConfig], acceptance: AcceptanceTable, costs: CycleCosts) -> list[Prediction]:
    """Every predictable shape's prediction, fastest first: by predicted speedup over the plain
    step, every shape's costs on the common time base (``CycleCosts.on_common_base``), which a drift of
    the machine's speed between shapes leaves alone (ties: the cheaper verify)."""
    preds = [p for p in (predict(s, acceptance, costs) for s in shapes) if p is not None]
    return sorted(preds, key=lambda p: (-p.speedup, p.shape.num_draft_tokens, p.shape.num_steps))


@dataclass
class AdaptiveShape:
    """Re-chooses a request's shape every ``every`` cycles from the same cost model, with the
    acceptance table rescaled by what this request's cycles have accepted so far (its domain
    shows after a few dozen tokens: math accepts more than summarization). Only the shape
    changes, never how tokens are accepted, so losslessness is untouched."""

    shapes: Sequence[SpecConfig]
    acceptance: AcceptanceTable
    costs: CycleCosts
    current: SpecConfig
    every: int = 8
    min_cycles: int = 8
    prior_cycles: float = 8.0  # how many cycles' weight the table's own figures keep
    observed: dict[int, list[float]] = field(default_factory=dict)  # topk -> [cycles, accepted, expected]
    cycles: int = 0
    changes: list[tuple[int, str]] = field(default_factory=list)  # (cycle, shape key) when it changed

    def record(self, shape: SpecConfig, accepted: int) -> SpecConfig:
        """Note one cycle of ``shape`` that accepted ``accepted`` draft tokens; the shape for the next."""
        o = self.observed.setdefault(shape.topk, [0.0, 0.0, 0.0])
        o[0] += 1
        o[1] += accepted
        o[2] += self.acceptance.accept_length(shape) - 1 if self.acceptance.covers(shape) else accepted
        self.cycles += 1
        if self.cycles >= self.min_cycles and self.cycles % self.every == 0:
            best = best_shape(self.shapes, self.adapted(), self.costs)
            if best and best[0].shape != self.current:
                self.current = best[0].shape
                self.changes.append((self.cycles, shape_key(self.current)))
        return self.current

    def factor(self) -> dict[int, float]:
        """Accepted over expected, shrunk toward 1 by ``prior_cycles`` of the table's own figure;
        a top-k not yet tried takes the pooled factor of the others."""
        acc = sum(o[1] for o in self.observed.values())
        exp = sum(o[2] for o in self.observed.values())
        n = sum(o[0] for o in self.observed.values())
        prior = self.prior_cycles * (exp / n if n else 1.0)
        pooled = (acc + prior) / (exp + prior) if exp + prior > 0 else 1.0
        out = dict.fromkeys(self.acceptance.per_position, pooled)
        for k, (c, a, e) in self.observed.items():
            p = self.prior_cycles * (e / c if c else 1.0)
            out[k] = (a + p) / (e + p) if e + p > 0 else 1.0
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def adapted(self) -> AcceptanceTable:
        return self.acceptance.rescaled(self.factor())

