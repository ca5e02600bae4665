"""Prometheus text exposition: the one parser (``bench --endpoint`` reading our, vLLM's and
SGLang's /metrics; the load test) and, beside it, the renderer our server's /metrics uses."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict
    value: float


class Family(NamedTuple):
    """One metric: ``# HELP`` and ``# TYPE`` lines, then its samples (possibly none)."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    samples: list[Sample]


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


# ---------------------------------------------------------------- rendering

def format_value(x: float) -> str:
    """A sample value as Prometheus writes it: integers as integers, floats by ``repr``
    (round-trips exactly), infinities as ``+Inf``/``-Inf``."""
    if isinstance(x, float):
        if math.isinf(x):
            return "+Inf" if x > 0 else "-Inf"
        return "NaN" if math.isnan(x) else repr(x)
    return str(x)


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample_line(sample: Sample) -> str:
    """``name{label="value",...} value``; the braces only when there are labels."""
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
    return f"{sample.name}{{{labels}}} {format_value(sample.value)}" if labels else \
        f"{sample.name} {format_value(sample.value)}"


def histogram_samples(name: str, bounds: Iterable[float], counts: Iterable[int], total: float) -> list[Sample]:
    """A histogram's samples from per-bucket (not cumulative) ``counts``, the last one for +Inf:
    cumulative ``_bucket{le=...}`` samples, then ``_sum`` and ``_count``."""
    out, running = [], 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        out.append(Sample(f"{name}_bucket", {"le": format_value(bound)}, running))
    return out + [Sample(f"{name}_sum", {}, total), Sample(f"{name}_count", {}, running)]


def render_prometheus(families: Iterable[Family]) -> str:
    """The text exposition (version 0.0.4) of ``families``, newline-terminated."""
    lines: list[str] = []
    for f in families:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind}", *map(sample_line, f.samples)]
    return "\n".join(lines) + "\n"


def single(name: str, kind: str, help_: str, value: float) -> Family:
    """A family of one unlabelled sample (a plain counter or gauge)."""
    return Family(name, kind, help_, [Sample(name, {}, value)])


# ---------------------------------------------------------------- parsing

def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (``name{label="v",...} value [timestamp]``);
    ``#`` lines and lines that do not parse are skipped."""
    samples = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _METRIC_NAME.match(line)
        if not m:
            continue
        name, rest = m.group(0), line[m.end():]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            pos = 1
            while True:
                lm = _LABEL.match(rest, pos)
                if not lm:
                    break
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
            close = rest.find("}", pos)
            if close < 0 or rest[pos:close].strip():
                continue
            rest = rest[close + 1:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        samples.append(Sample(name, labels, value))
    return samples
