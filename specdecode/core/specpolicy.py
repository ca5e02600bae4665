"""When continuous batching speculates: per batch size, fixed, calibrated before serving, or
adaptive (``SpecPolicy``); ``core.batching.BatchEngine`` asks it before every decode step."""

from __future__ import annotations

from typing import Literal

SpecPolicyName = Literal["always", "never", "auto", "adaptive"]
SPEC_POLICIES: tuple[SpecPolicyName, ...] = ("always", "never", "auto", "adaptive")
# 'auto' measures both modes once per batch size bucket before serving (``BatchEngine.calibrate``), so its
# choice is a function of the batch size: a greedy or seeded request gives the same answer every time.
# 'adaptive' (the earlier 'auto') re-decides from step times measured while serving: it follows the load,
# but bf16 rounds plain and speculative steps differently, so a repeated request can change (issue 26).
CALIBRATION_STEPS = 6  # timed steps of each mode per batch size bucket, after one untimed step of each
# A CPU burst during the timing (another process) once left a few tok/s for the server's life: a
# bucket is timed again, up to CALIBRATION_ROUNDS rounds, while a mode's median step is more than
# CALIBRATION_SPREAD times its fastest one, and each mode is judged by its fastest step of all rounds.
CALIBRATION_ROUNDS = 3
CALIBRATION_SPREAD = 1.5


class SpecPolicy:
    """When to speculate, per batch size. 'always' and 'never' are fixed; 'auto' takes, per batch
    size bucket (powers of two), the mode ``BatchEngine.calibrate`` measured faster before serving
    (speculative until calibrated, and for buckets it could not measure); 'adaptive' predicts both
    modes' tokens per second at the batch's size and takes the faster: a plain step gives one
    token per row, a speculative step the measured accept length per row (counted over every
    speculative step, whatever its size: acceptance is a property of drafter and prompts), each
    over its measured step time at that size (a moving average: step times are steady, single
    steps' acceptance is not). Each mode is measured ``warmup`` times at a size first, then the
    other mode is re-tried every ``explore_every`` steps (costs change with the requests)."""

    def __init__(self, name: SpecPolicyName, can_speculate: bool, warmup: int = 2, explore_every: int = 16,
                 decay: float = 0.8, accept_decay: float = 0.995) -> None:
        self.name = name if can_speculate else "never"
        self.warmup, self.explore_every = warmup, explore_every
        self.decay, self.accept_decay = decay, accept_decay
        self.step_s: dict[tuple[int, bool], float] = {}  # (batch, spec) -> seconds per step (moving average)
        self.seen: dict[tuple[int, bool], int] = {}
        self.decisions: dict[int, int] = {}  # batch size -> 'adaptive' choices made (every explore_every-th explores)
        self.spec_tokens = 0.0  # tokens of speculative steps (slowly forgotten) ...
        self.spec_rows = 0.0  # ... over the rows they decoded: the accept length per row
        self.calibrated: dict[int, bool] = {}  # 'auto': batch size bucket -> speculate (BatchEngine.calibrate)
        self.calibrated_rates: dict[int, tuple[float, float]] = {}  # bucket -> measured (spec, plain) tok/s
        self.calibrated_spread: dict[int, float] = {}  # bucket -> the last round's median / fastest step

    @property
    def accept_length(self) -> float:
        return self.spec_tokens / self.spec_rows if self.spec_rows else 1.0

    def rate(self, batch: int, spec: bool) -> float:
        """Predicted tokens per second of a step of ``batch`` rows."""
        return batch * (self.accept_length if spec else 1.0) / max(self.step_s[batch, spec], 1e-9)

    def choose(self, batch: int) -> bool:
        if self.name in ("always", "never"):
            return self.name == "always"
        if self.name == "auto":
            buckets = [b for b in self.calibrated if b <= batch]
            return self.calibrated[max(buckets)] if buckets else True
        for spec in (True, False):
            if self.seen.get((batch, spec), 0) < self.warmup:
                return spec
        best = self.rate(batch, True) >= self.rate(batch, False)
        self.decisions[batch] = self.decisions.get(batch, 0) + 1
        return (not best) if self.decisions[batch] % self.explore_every == 0 else best

    def record(self, batch: int, spec: bool, tokens: int, seconds: float) -> None:
        key = (batch, spec)
        old = self.step_s.get(key)
        self.step_s[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self.seen[key] = self.seen.get(key, 0) + 1
        if spec:
            self.spec_tokens = self.accept_decay * self.spec_tokens + tokens
            self.spec_rows = self.accept_decay * self.spec_rows + batch

    def decide(self, batch: int, plain_s: float, spec_s: float, spec_tokens: float) -> bool:
        """'auto' for this batch size bucket from one calibration: speculate when its steps' tokens
        per second (``spec_tokens`` per ``spec_s``) beat a plain step's ``batch`` per ``plain_s``."""
        spec_rate, plain_rate = spec_tokens / max(spec_s, 1e-9), batch / max(plain_s, 1e-9)
        self.calibrated[batch] = spec_rate >= plain_rate
        self.calibrated_rates[batch] = (spec_rate, plain_rate)  # per bucket: each has its own accept count
        for spec, seconds in ((False, plain_s), (True, spec_s)):
            self.step_s[batch, spec] = seconds
        return self.calibrated[batch]

    def to_dict(self) -> dict[str, dict[str, float]]:
        """Predicted tokens/s per batch size and mode (for logs and reports)."""
        out: dict[str, dict[str, float]] = {}
        for batch, spec in sorted(self.step_s):
            out.setdefault(str(batch), {})["spec" if spec else "plain"] = self.rate(batch, spec)
        return out
