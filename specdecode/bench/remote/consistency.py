"""The same request, the same answer, from a running server (``check --endpoint``): each prompt sent greedy
and seeded, first alone and streamed (the reference), then alone not streamed, alone again, and N copies at
once for each N of ``copies``; every answer is compared with the reference. A server that batches requests
must give a request the tokens it gives it alone: what a user of ``temperature 0`` or a fixed ``seed`` relies on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from specdecode.bench.remote.request import RequestResult, _request_body, stream_one
from specdecode.bench.remote.run import RemoteError, _model_entries, normalize_endpoint

MODES = ("greedy", "seeded")


@dataclass(frozen=True)
class ConsistencyConfig:
    copies: tuple[int, ...] = (4, 16)  # requests sent at once, each count its own column
    max_new_tokens: int = 64
    temperature: float = 0.8  # the seeded requests'
    seed: int = 1234
    timeout_s: float = 600.0


@dataclass
class PromptCheck:
    """One prompt in one mode: the reference answer and, per way of sending it, how many answers equalled it."""

    prompt_id: str
    mode: str
    reference: str
    same: dict[str, int] = field(default_factory=dict)  # way -> answers equal to the reference
    sent: dict[str, int] = field(default_factory=dict)  # way -> answers received
    first_other: dict[str, str] = field(default_factory=dict)  # way -> the first answer that differed
    errors: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return not self.errors and all(self.same[w] == self.sent[w] for w in self.same)


@dataclass
class ConsistencyReport:
    endpoint: str
    model: str
    config: ConsistencyConfig
    checks: list[PromptCheck]
    wall_s: float

    def ways(self) -> list[str]:
        return list(dict.fromkeys(w for c in self.checks for w in c.same))

    def table(self) -> list[dict]:
        """Per mode: prompts whose every answer sent each way equalled the reference, and in all ways."""
        rows = []
        for mode in MODES:
            checks = [c for c in self.checks if c.mode == mode]
            if not checks:
                continue
            row: dict = {"mode": mode, "prompts": len(checks)}
            for way in self.ways():
                row[way] = sum(c.same.get(way) == c.sent.get(way) and way in c.same for c in checks)
            row["all"] = sum(c.consistent for c in checks)
            row["errors"] = sum(len(c.errors) for c in checks)
            rows.append(row)
        return rows

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint, "model": self.model, "config": asdict(self.config),
                "wall_s": self.wall_s, "table": self.table(), "checks": [asdict(c) for c in self.checks]}


@dataclass(frozen=True)
class _Sender:
    """One request body, sent streamed or whole; a failure is recorded in the result, never raised."""

    client: httpx.Client
    url: str
    body: dict
    headers: dict
    timeout_s: float

    def streamed(self, _: int = 0) -> RequestResult:
        res = RequestResult("", "")
        stream_one(self.client, self.url, self.body, self.headers, "chat", self.timeout_s, res, time.perf_counter())
        return res

    def whole(self) -> RequestResult:
        res = RequestResult("", "")
        plain = {k: v for k, v in self.body.items() if k != "stream_options"} | {"stream": False}
        try:
            r = self.client.post(self.url, json=plain, headers=self.headers)
            r.raise_for_status()
            res.text = r.json()["choices"][0]["message"]["content"] or ""
            res.ok = True
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
        return res


def check_endpoint(endpoint: str, prompts: Sequence, config: ConsistencyConfig = ConsistencyConfig(), *,
                   model: str | None = None, api_key: str | None = None,
                   on_prompt: Callable[[PromptCheck], None] | None = None) -> ConsistencyReport:
    """See the module doc. Raises :class:`RemoteError` when the endpoint lists no model and none is named."""
    if not config.copies or min(config.copies) < 1:
        raise ValueError(f"copies must be counts of at least 1, got {config.copies}")
    base = normalize_endpoint(endpoint)
    url = base + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    most = max(config.copies)
    limits = httpx.Limits(max_connections=most + 2, max_keepalive_connections=most + 2)
    client = httpx.Client(timeout=httpx.Timeout(config.timeout_s, connect=30.0), limits=limits)
    t0 = time.perf_counter()
    checks: list[PromptCheck] = []
    try:
        if model is None:
            model = _model_entries(base, headers, 30.0, client)[0]["id"]
        with ThreadPoolExecutor(max_workers=most) as pool:
            for i, prompt in enumerate(prompts):
                for mode in MODES:
                    sampling = ({"temperature": 0.0} if mode == "greedy" else
                                {"temperature": config.temperature, "seed": config.seed})
                    body = _request_body(prompt, i, "chat", model, config.max_new_tokens, 0.0, sampling)
                    send = _Sender(client, url, body, headers, config.timeout_s)
                    ref = send.streamed()
                    check = PromptCheck(str(getattr(prompt, "id", i)), mode, ref.text)
                    if not ref.ok:
                        check.errors.append(f"reference: {ref.error}")
                    answers = {"not streamed": [send.whole()], "again": [send.streamed()]}
                    for n in config.copies:
                        answers[f"{n} at once"] = list(pool.map(send.streamed, range(n)))
                    for way, got in answers.items():
                        check.errors += [f"{way}: {r.error}" for r in got if not r.ok]
                        check.sent[way] = sum(r.ok for r in got)
                        check.same[way] = sum(r.ok and r.text == ref.text for r in got)
                        other = next((r.text for r in got if r.ok and r.text != ref.text), None)
                        if other is not None:
                            check.first_other[way] = other
                    checks.append(check)
                    if on_prompt is not None:
                        on_prompt(check)
    finally:
        client.close()
    if model is None:
        raise RemoteError(f"{base}: no model to request")
    return ConsistencyReport(base, model, config, checks, time.perf_counter() - t0)
