"""Per-phase timing of speculative cycles and the counters derived from them.

Always on and cheap: a handful of perf_counter reads per cycle. On CUDA the clock
synchronizes the device before each reading (``sync=True``) so a phase is charged with
its own kernels; ``sync=False`` shows the asynchronous view (launch cost only).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

PHASES = ("draft", "verify", "allreduce", "extend", "other")
PHASE_LABELS = {"draft": "Draft steps", "verify": "Target verify", "allreduce": "All-reduce (TP)",
                "extend": "Draft re-extend", "other": "Other overhead"}


class TimeMeter(Protocol):
    """Cumulative seconds spent in some activity inside the model (tensor parallelism's
    all-reduces: ``specdecode.runtime.sharding.CommMeter``), read before and after a phase."""

    @property
    def seconds(self) -> float: ...


class PhaseClock:
    """Marks phase boundaries: ``start()``, then ``mark(phase)`` after each phase. With a
    collective meter (``comm``), time inside all-reduces is moved out of the phase it
    happened in (the target's verify pass) into the 'allreduce' phase."""

    def __init__(self, device: torch.device | str, sync: bool = True, comm: TimeMeter | None = None) -> None:
        self.sync = sync and torch.device(device).type == "cuda"
        self.device = device
        self.comm = comm
        self.t0 = self.last = self.last_comm = 0.0
        self.times: dict[str, float] = {}

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.t0 = self.last = self._now()
        self.last_comm = self.comm.seconds if self.comm else 0.0
        self.times = {}

    def mark(self, phase: str) -> None:
        now = self._now()
        comm = 0.0
        if self.comm:
            comm, self.last_comm = self.comm.seconds - self.last_comm, self.comm.seconds
            self.times["allreduce"] = self.times.get("allreduce", 0.0) + comm
        self.times[phase] = self.times.get(phase, 0.0) + now - self.last - comm
        self.last = now

    def wait(self) -> None:
        """What makes a span of time the device's own work (``sync`` on CUDA), for meters inside a phase."""
        if self.sync:
            torch.cuda.synchronize(self.device)

    def finish(self) -> dict[str, float]:
        """Phase times of this cycle; time not inside a marked phase counts as 'other'."""
        total = self._now() - self.t0
        times = dict(self.times)
        times["other"] = times.get("other", 0.0) + max(0.0, total - sum(self.times.values()))
        times["total"] = total
        return times


@dataclass
class CycleRecord:
    drafted: int  # draft tokens verified (tree nodes minus the root)
    accepted: int  # draft tokens accepted (the bonus token not included)
    times: dict[str, float]  # seconds per phase, plus "total"
    ngram_drafted: int = 0  # of ``drafted``: nodes only the n-gram proposal drafted (``core.ngram``)
    ngram_accepted: int = 0  # of ``accepted``: tokens only the n-gram proposal drafted


@dataclass
class SpecProfile:
    """Aggregate over cycles: accept length (bonus included; baseline = 1.0), accept rate
    (accepted / drafted), per-position acceptance, histogram, per-phase time."""

    cycles: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    max_depth: int = 0
    depth_hist: Counter[int] = field(default_factory=Counter)  # accepted draft tokens per cycle -> count
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PHASES, "total"), 0.0))
    prefill_s: float = 0.0
    shape_changes: list[tuple[int, str]] = field(default_factory=list)  # an adaptive shape: (cycle, new shape)
    ngram_drafted: int = 0
    ngram_accepted: int = 0

    def add(self, record: CycleRecord) -> None:
        self.cycles += 1
        self.tokens += record.accepted + 1
        self.drafted += record.drafted
        self.accepted += record.accepted
        self.depth_hist[record.accepted] += 1
        self.max_depth = max(self.max_depth, record.drafted)
        self.ngram_drafted += record.ngram_drafted
        self.ngram_accepted += record.ngram_accepted
        for k, v in record.times.items():
            self.phase_s[k] = self.phase_s.get(k, 0.0) + v

    @property
    def accept_length(self) -> float:
        return self.tokens / self.cycles if self.cycles else float("nan")

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def per_position_accept(self, depth: int) -> list[float]:
        """Share of cycles whose accepted path reached draft position i (1-based)."""
        if not self.cycles:
            return []
        return [sum(c for a, c in self.depth_hist.items() if a >= i) / self.cycles for i in range(1, depth + 1)]

    def to_dict(self, depth: int) -> dict[str, Any]:
        per_cycle_ms = {p: 1000 * self.phase_s[p] / self.cycles if self.cycles else 0.0 for p in (*PHASES, "total")}
        total = self.phase_s["total"] or 1e-12
        return {
            "cycles": self.cycles,
            "accept_length": self.accept_length,
            "accept_rate": self.accept_rate,
            "per_position_accept": self.per_position_accept(depth),
            "accept_length_histogram": {str(a + 1): c for a, c in sorted(self.depth_hist.items())},
            "phases": {p: {"ms_per_cycle": per_cycle_ms[p], "share": self.phase_s[p] / total} for p in PHASES},
            "cycle_ms": per_cycle_ms["total"],
            # inside the cycle but outside model calls (core.runner.MeteredRunner), and model calls a cycle
            "host_ms_per_cycle": 1000 * self.phase_s.get("host", 0.0) / self.cycles if self.cycles else 0.0,
            "model_calls_per_cycle": self.phase_s.get("calls", 0.0) / self.cycles if self.cycles else 0.0,
            "prefill_ms": 1000 * self.prefill_s,
            "decode_tok_per_s": self.tokens / total if self.cycles else float("nan"),
            **({"shape_changes": [list(c) for c in self.shape_changes]} if self.shape_changes else {}),
            # accepted draft tokens by proposer (a token both drafted counts for the head)
            **({"accepted_by": {"eagle3": self.accepted - self.ngram_accepted, "ngram": self.ngram_accepted},
                "ngram_drafted": self.ngram_drafted} if self.ngram_drafted else {}),
        }


def format_profile(stats: dict[str, Any], title: str = "EAGLE3 profile") -> str:
    """The text table of a profile dict (``SpecProfile.to_dict`` plus ``num_tokens``)."""
    lines = [f"{title} ({stats['cycles']} cycles, {stats.get('num_tokens', '?')} tok)"]
    for p in PHASES:
        ph = stats["phases"].get(p)
        if ph is None or (p == "allreduce" and not ph["ms_per_cycle"]):
            continue  # no tensor parallelism: no all-reduce line
        lines.append(f"  {PHASE_LABELS[p] + ':':<18}{ph['ms_per_cycle']:7.2f} ms/cyc ({100 * ph['share']:5.1f}%)")
    lines.append(f"  {'TOTAL:':<18}{stats['cycle_ms']:7.2f} ms/cyc")
    if "host_ms_per_cycle" in stats:
        host = stats["host_ms_per_cycle"]
        lines.append(f"  {'of which host:':<18}{host:7.2f} ms/cyc ({100 * host / (stats['cycle_ms'] or 1e-12):5.1f}%)"
                     f"  outside {stats['model_calls_per_cycle']:.1f} model calls a cycle")
    if "loop_ms_per_cycle" in stats:
        lines.append(f"  {'Loop, not cycle:':<18}{stats['loop_ms_per_cycle']:7.2f} ms/cyc  (text, stops, the step "
                     "around the cycle)")
    lines.append(f"  Accept len: {stats['accept_length']:.2f}  accept rate: {stats['accept_rate']:.2f}  "
                 f"eff tok/s: {stats.get('tok_per_s', stats['decode_tok_per_s']):.1f}")
    pos = " ".join(f"{x:.2f}" for x in stats["per_position_accept"])
    lines.append(f"  Per-position accept: {pos}")
    hist = " ".join(f"{k}:{v}" for k, v in stats["accept_length_histogram"].items())
    lines.append(f"  Accept length histogram: {hist}")
    if "accepted_by" in stats:
        by = stats["accepted_by"]
        lines.append(f"  Accepted by proposer: eagle3 {by['eagle3']}, ngram {by['ngram']} "
                     f"(of {stats['ngram_drafted']} n-gram tokens verified)")
    return "\n".join(lines)
