"""``bench --endpoint``: the same prompts, runs, summary and store as a local bench, measured
over HTTP streaming against any OpenAI-compatible server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from specdecode.bench.fingerprint import capture
from specdecode.bench.output import MeasureConfig, summarize
from specdecode.bench.remote.request import Api, RequestResult
from specdecode.bench.remote.run import RemoteError, measure_endpoint, short_model_id
from specdecode.bench.store import ResultsStore, Run, new_run_id, now
from specdecode.io.prompts import Prompt


@dataclass(frozen=True)
class EndpointConfig:
    url: str  # the server (root or any /v1/... URL)
    model: str | None = None  # None: the first of /v1/models
    api: Api = "chat"
    concurrency: int = 1  # requests in flight at once
    api_key: str | None = None
    temperature: float = 0.0


@dataclass
class EndpointBench:
    endpoint: EndpointConfig
    measure: MeasureConfig
    prompts: int
    records: list[dict]  # successful requests, shaped like a local bench's records
    summary: list[dict]
    remote: list[dict]  # per run: summarize_run(...) | {"run": i}
    fingerprint: dict

    @property
    def failed(self) -> int:
        return sum(s["failed"] for s in self.remote)

    @property
    def errors(self) -> dict[str, int]:
        """Failure message -> count over all runs."""
        out: dict[str, int] = {}
        for s in self.remote:
            for k, v in s["errors"].items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def hints(self) -> list[str]:
        """Likely causes of failures and notes on token counts, over all runs, each once."""
        return list(dict.fromkeys(h for s in self.remote for h in s["hints"]))

    def to_run(self) -> Run:
        return Run(new_run_id(), "bench-remote", now(), self.fingerprint, self.summary, self.records,
                   {"endpoint": self.endpoint.url, "max_new_tokens": self.measure.max_new_tokens,
                    "remote": self.remote})


def bench_endpoint(endpoint: EndpointConfig, config: MeasureConfig, prompts: list[Prompt] | None = None,
                   on_done: Callable[[RequestResult], None] | None = None) -> EndpointBench:
    """``config.runs`` passes over the prompts (default: ``config.load_prompts()``; warmup before the
    first pass); ``on_done`` is called as each request finishes."""
    prompts = config.load_prompts() if prompts is None else prompts
    fingerprint = capture(threads=torch.get_num_threads(), dtype="(server)", device="remote") | {
        "endpoint": endpoint.url, "concurrency": endpoint.concurrency, "api": endpoint.api}
    records: list[dict] = []
    remote: list[dict] = []
    method = ""
    for run in range(config.runs):
        try:
            rr = measure_endpoint(endpoint.url, prompts, model=endpoint.model, max_new_tokens=config.max_new_tokens,
                                  concurrency=endpoint.concurrency, api=endpoint.api, api_key=endpoint.api_key,
                                  temperature=endpoint.temperature, warmup=config.warmup if run == 0 else 0,
                                  on_done=on_done)
        except RemoteError as e:
            raise ValueError(f"{e} (is the server at {endpoint.url} running?)") from None
        method = f"remote:{short_model_id(rr.model)}"  # the full id is in the fingerprint
        records += rr.records(method, run)
        remote.append(rr.summary() | {"run": run})
        fingerprint["server_model"] = rr.model
        fingerprint["server_software"] = rr.server
        fingerprint["server_version"] = rr.server_version
    summary = summarize(records, [method]) if records else []
    for row in summary:
        row["outputs_match_baseline"] = "n/a"  # one method, its own reference
        row |= server_acceptance(remote)
    return EndpointBench(endpoint, config, len(prompts), records, summary, remote, fingerprint)


def server_acceptance(remote: list[dict]) -> dict[str, float]:
    """Accept length and rate over every run from the server's own counters (their deltas summed), for the
    summary row; {} where the server reported none (a plain server, or counters it does not expose)."""
    spec = [s["server_spec"] for s in remote if s.get("server_spec")]
    cycles = sum(s.get("cycles") or 0 for s in spec)
    accepted = sum(s.get("accepted_tokens") or 0 for s in spec)
    drafted = sum(s.get("draft_tokens") or 0 for s in spec)
    if cycles:
        return {"accept_length": 1 + accepted / cycles} | ({"accept_rate": accepted / drafted} if drafted else {})
    lengths = [s["accept_length"] for s in spec if s.get("accept_length") is not None]  # SGLang: a gauge only
    return {"accept_length": sum(lengths) / len(lengths)} if lengths else {}


def link_launch(fingerprint: dict, store: ResultsStore) -> str | None:
    """The newest ``specdecode launch`` recorded in ``store`` for this endpoint (its port, and its host or a
    wildcard one): its run id, time and command go into ``fingerprint`` (the engine's flags and versions are in
    that run). Returns the run id, or None."""
    want = urlsplit(fingerprint.get("endpoint") or "")
    for run in store.runs_of_kind("launch"):
        launch = run.fingerprint.get("launch") or {}
        got = urlsplit(launch.get("endpoint") or "")
        if got.port == want.port and got.hostname in (want.hostname, "0.0.0.0", "::"):
            fingerprint["launch_run"] = {"run_id": run.run_id, "created": run.created,
                                         "command": launch.get("command"),
                                         "engine_versions": launch.get("engine_versions")}
            return run.run_id
    return None

