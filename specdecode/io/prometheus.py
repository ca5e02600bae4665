"""Prometheus text exposition: the one parser (``bench --endpoint`` reading our, vLLM's and
SGLang's /metrics; the load test) and, beside it, the renderer our server's /metrics uses."""

from __future__ import annotations

import re
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict
    value: float


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


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
