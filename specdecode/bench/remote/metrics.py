"""The server's own speculative-decoding metrics, snapshotted before and after a run: our, vLLM's
and llama-server's Prometheus counters at ``/metrics``, SGLang's ``avg_spec_accept_length`` gauge at
``/get_server_info``; ``spec_delta`` turns two snapshots into the run's figures (see the
package doc for the sources and keys)."""

from __future__ import annotations

import statistics
from typing import Any

import httpx

from specdecode.io.prometheus import Sample, parse_prometheus


def _counter(samples: list[Sample], base: str, by: str | None = None) -> dict:
    """Sum of the counter ``base`` (``base_total``, or bare ``base``) over all labels but ``by``:
    ``{None: total}``, or ``{label value: total}`` with ``by``. Empty if absent."""
    for name in (base + "_total", base):
        hits = [s for s in samples if s.name == name]
        if hits:
            out: dict = {}
            for s in hits:
                key = s.labels.get(by) if by else None
                out[key] = out.get(key, 0.0) + s.value
            return out
    return {}


COUNTER_SOURCES: dict[str, dict[str, Any]] = {
    "specdecode": {
        "cycles": "specdecode_spec_cycles", "draft_tokens": "specdecode_spec_draft_tokens",
        "accepted_tokens": "specdecode_spec_accepted_tokens",
        "per_position": "specdecode_spec_accepted_per_position", "first_position": 1,
    },
    "vllm": {
        "cycles": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
        "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
        "per_position": "vllm:spec_decode_num_accepted_tokens_per_pos", "first_position": 0,
    },
    # llama-server (b11434; started with --metrics, as `launch llamacpp` does): vLLM's names, its prefix
    "llamacpp": {
        "cycles": "llamacpp:spec_decode_num_drafts", "draft_tokens": "llamacpp:spec_decode_num_draft_tokens",
        "accepted_tokens": "llamacpp:spec_decode_num_accepted_tokens",
        "per_position": "llamacpp:spec_decode_num_accepted_tokens_per_pos", "first_position": 0,
    },
}


def _counter_snapshot(samples: list[Sample]) -> dict | None:
    for source, names in COUNTER_SOURCES.items():
        cycles = _counter(samples, names["cycles"])
        accepted = _counter(samples, names["accepted_tokens"])
        if not (cycles or accepted):  # (vLLM's V0 engine had no drafts counter: rates only)
            continue
        per_pos = {}
        for pos, v in _counter(samples, names["per_position"], by="position").items():
            try:
                per_pos[int(pos) - names["first_position"]] = v  # 0 = first draft position
            except (TypeError, ValueError):
                continue
        return {"source": source, "cycles": cycles.get(None),
                "draft_tokens": _counter(samples, names["draft_tokens"]).get(None),
                "accepted_tokens": accepted.get(None), "per_position": per_pos}
    return None


def _sglang_accept_length(info) -> float | None:
    if not isinstance(info, dict):
        return None
    value = info.get("avg_spec_accept_length")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raw = [s.get("avg_spec_accept_length") for s in info.get("internal_states") or [] if isinstance(s, dict)]
    values = [float(v) for v in raw if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.fmean(values) if values else None


def read_spec_snapshot(client: httpx.Client, base: str, headers: dict | None = None,
                       timeout_s: float = 10.0) -> tuple[dict | None, str | None]:
    """The server's speculative metrics now: ``(snapshot, None)`` or ``(None, reason)``."""
    tried = []
    try:
        r = client.get(base + "/metrics", headers=headers, timeout=timeout_s)
        if r.status_code == 200:
            snap = _counter_snapshot(parse_prometheus(r.text))
            if snap:
                return snap, None
            tried.append("/metrics: no speculative-decoding counters")
        else:
            tried.append(f"/metrics: HTTP {r.status_code}")
    except httpx.HTTPError as e:
        tried.append(f"/metrics: {type(e).__name__}: {e}")
    for path in ("/get_server_info", "/server_info"):
        try:
            r = client.get(base + path, headers=headers, timeout=timeout_s)
            if r.status_code != 200:
                tried.append(f"{path}: HTTP {r.status_code}")
                continue
            value = _sglang_accept_length(r.json())
            if value is not None:
                return {"source": "sglang", "accept_length": value}, None
            tried.append(f"{path}: no avg_spec_accept_length")
            break
        except (httpx.HTTPError, ValueError) as e:
            tried.append(f"{path}: {type(e).__name__}: {e}")
    return None, "no speculative metrics on the server (" + "; ".join(tried) + ")"


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """Speculative metrics over the run, from snapshots taken before and after it."""
    if after is None:
        return None
    if after["source"] == "sglang":
        return {"source": "sglang", "accept_length": after["accept_length"],
                "accept_length_before": before.get("accept_length") if before and
                before["source"] == "sglang" else None}
    note = None
    if before is None or before["source"] != after["source"]:
        note = "no snapshot before the run: totals since the server started"
        before = {"cycles": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "per_position": {}}

    def diff(key):
        if after.get(key) is None:
            return None
        return after[key] - (before.get(key) or 0.0)

    cycles, drafted, accepted = diff("cycles"), diff("draft_tokens"), diff("accepted_tokens")
    per_pos = {p: v - before["per_position"].get(p, 0.0) for p, v in after["per_position"].items()}
    ran = bool(cycles and cycles > 0)
    return ({"note": note} if note else {}) | {
        "source": after["source"], "cycles": cycles, "draft_tokens": drafted, "accepted_tokens": accepted,
        "accept_length": 1 + accepted / cycles if ran and accepted is not None else None,
        "accept_rate": accepted / drafted if accepted is not None and drafted else None,
        "per_position": [per_pos.get(p, 0.0) / cycles for p in range(max(per_pos) + 1)]
        if ran and per_pos else None,
    }
