"""A measured run against an endpoint: ``measure_endpoint`` sends every prompt as a streaming
request, ``concurrency`` at a time, between two snapshots of the server's speculative metrics;
``RemoteRun`` holds the requests, ``summarize_run`` and ``to_records`` aggregate them."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass

import httpx

from specdecode.bench.remote.metrics import read_spec_snapshot, spec_delta
from specdecode.bench.remote.request import Api, RequestResult, _median, _ms, _prompt_fields, _request_body, _stream_one
from specdecode.bench.stats import percentile


class RemoteError(RuntimeError):
    """The endpoint cannot be measured at all (e.g. no model id could be found)."""


# ---------------------------------------------------------------------------------------------
# small helpers


def normalize_endpoint(endpoint: str) -> str:
    """The server root: ``http://h:8000/v1/chat/completions`` -> ``http://h:8000``."""
    url = endpoint.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
            break
    if url.endswith("/v1"):
        url = url[:-3]
    return url.rstrip("/")


@dataclass
class RemoteRun:
    endpoint: str
    api: str
    model: str
    max_new_tokens: int
    concurrency: int
    temperature: float
    started_at: float
    wall_s: float
    results: list[RequestResult]
    server_spec: dict | None
    server_spec_reason: str | None = None

    def summary(self) -> dict:
        return summarize_run(self)

    def records(self, method: str = "remote", run: int = 0) -> list[dict]:
        return to_records(self, method, run)

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint, "api": self.api, "model": self.model,
                "max_new_tokens": self.max_new_tokens, "concurrency": self.concurrency,
                "temperature": self.temperature, "started_at": self.started_at, "wall_s": self.wall_s,
                "summary": self.summary(), "requests": [asdict(r) for r in self.results]}


def list_models(endpoint: str, api_key: str | None = None, timeout_s: float = 30.0,
                client: httpx.Client | None = None) -> list[str]:
    """The model ids served at ``endpoint`` (``GET /v1/models``); raises :class:`RemoteError`."""
    base = normalize_endpoint(endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    try:
        r = client.get(base + "/v1/models", headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            raise RemoteError(f"GET {base}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
        ids = [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    except httpx.HTTPError as e:
        raise RemoteError(f"GET {base}/v1/models: {type(e).__name__}: {e}") from e
    except (ValueError, AttributeError, TypeError) as e:
        raise RemoteError(f"GET {base}/v1/models: unexpected response ({e})") from e
    finally:
        if own:
            client.close()
    if not ids:
        raise RemoteError(f"GET {base}/v1/models: no models listed; pass the model name")
    return ids


def measure_endpoint(endpoint: str, prompts: list, *, model: str | None = None, max_new_tokens: int = 128,
                     concurrency: int = 1, api: Api = "chat", api_key: str | None = None,
                     temperature: float = 0.0, timeout_s: float = 300.0, warmup: int = 0,
                     extra_body: dict | None = None,
                     on_done: Callable[[RequestResult], None] | None = None) -> RemoteRun:
    """Send every prompt as a streaming request, ``concurrency`` at a time; see the module doc."""
    if api not in ("chat", "completions"):
        raise ValueError(f"api must be 'chat' or 'completions', not {api!r}")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    base = normalize_endpoint(endpoint)
    url = base + ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)), limits=limits)
    try:
        if model is None:
            model = list_models(base, api_key, min(timeout_s, 30.0), client)[0]
        for _ in range(warmup):
            if prompts:
                w = RequestResult("warmup", "warmup")
                _stream_one(client, url, _request_body(prompts[0], 0, api, model, min(max_new_tokens, 16),
                                                       temperature, extra_body),
                            headers, api, timeout_s, w, time.perf_counter())
        before, _ = read_spec_snapshot(client, base, headers)
        results = [RequestResult(*_prompt_fields(p, i)[:2]) for i, p in enumerate(prompts)]
        started_at = time.time()
        t_run = time.perf_counter()
        lock = threading.Lock()
        last_end = [t_run]

        def work(i: int) -> int:
            try:
                body = _request_body(prompts[i], i, api, model, max_new_tokens, temperature, extra_body)
            except Exception as e:  # a bad prompt fails its request, not the run
                results[i].error = f"cannot build the request: {type(e).__name__}: {e}"
                return i
            _stream_one(client, url, body, headers, api, timeout_s, results[i], t_run)
            with lock:
                last_end[0] = max(last_end[0], t_run + results[i].end_s)
            return i

        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="specdecode-remote")
        try:
            futures = [pool.submit(work, i) for i in range(len(prompts))]
            for f in as_completed(futures):
                i = f.result()
                if on_done is not None:
                    on_done(results[i])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        wall_s = last_end[0] - t_run
        after, reason = read_spec_snapshot(client, base, headers)
    finally:
        client.close()
    return RemoteRun(endpoint=base, api=api, model=model, max_new_tokens=max_new_tokens,
                     concurrency=concurrency, temperature=temperature, started_at=started_at,
                     wall_s=wall_s, results=results, server_spec=spec_delta(before, after),
                     server_spec_reason=reason)


# ---------------------------------------------------------------------------------------------
# aggregates


def summarize_run(run: RemoteRun) -> dict:
    """Per-run aggregate; see the module doc for the keys."""
    good = [r for r in run.results if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    tpots = [r.tpot_s for r in good if r.tpot_s is not None]
    itls = [x for r in good for x in r.itl_s]
    speeds = [r.tok_per_s for r in good if r.tok_per_s is not None]
    sources = {r.tokens_source for r in good}
    return {
        "requests": len(run.results), "ok": len(good), "failed": len(run.results) - len(good),
        "errors": dict(Counter(r.error for r in run.results if not r.ok).most_common()),
        "wall_s": run.wall_s, "completion_tokens": tokens,
        "output_tok_per_s": tokens / run.wall_s if run.wall_s > 0 and good else None,
        "request_tok_per_s_median": _median(speeds),
        "latency_ms_median": _ms(_median([r.latency_s for r in good])),
        "ttft_ms_median": _ms(_median(ttfts)), "ttft_ms_p90": _ms(percentile(ttfts, 90)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_median": _ms(_median(tpots)),
        "itl_ms_median": _ms(_median(itls)), "itl_ms_p90": _ms(percentile(itls, 90)),
        "itl_ms_p99": _ms(percentile(itls, 99)),
        "tokens_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None),
        "server_spec": run.server_spec, "server_spec_reason": run.server_spec_reason,
    }


def to_records(run: RemoteRun, method: str = "remote", run_index: int = 0) -> list[dict]:
    """Successful requests as ``bench`` records (``bench.summarize`` can consume them)."""
    out = []
    for r in run.results:
        if not r.ok:
            continue
        n = max(r.completion_tokens, 1)
        out.append({
            "method": method, "run": run_index, "prompt_id": r.prompt_id, "category": r.category,
            "prompt_tokens": r.prompt_tokens, "num_tokens": n, "token_ids": [],
            "elapsed_s": r.latency_s, "ttft_s": r.ttft_s, "tok_per_s": n / r.latency_s,
            "tpot_s": r.tpot_s, "itl_median_s": _median(r.itl_s), "tokens_source": r.tokens_source,
            "text": r.text,
        })
    return out
