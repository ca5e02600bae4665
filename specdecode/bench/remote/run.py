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
from specdecode.bench.remote.request import (
    CUT_SHORT,
    Api,
    RequestResult,
    _median,
    _ms,
    _prompt_fields,
    _request_body,
    stream_one,
)
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
    server: str | None = None  # the server software, when /v1/models reveals it (identify_server)
    server_version: str | None = None  # what the server says it is (``server_version``)

    def summary(self) -> dict:
        return summarize_run(self)

    def records(self, method: str = "remote", run: int = 0) -> list[dict]:
        return to_records(self, method, run)

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint, "api": self.api, "model": self.model, "server": self.server,
                "server_version": self.server_version, "max_new_tokens": self.max_new_tokens,
                "concurrency": self.concurrency,
                "temperature": self.temperature, "started_at": self.started_at, "wall_s": self.wall_s,
                "summary": self.summary(), "requests": [asdict(r) for r in self.results]}


def _model_entries(base: str, headers: dict, timeout_s: float, client: httpx.Client) -> list[dict]:
    """``GET /v1/models``'s entries (each with an ``id``); raises :class:`RemoteError`."""
    try:
        r = client.get(base + "/v1/models", headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            raise RemoteError(f"GET {base}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
        entries = [m for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    except httpx.HTTPError as e:
        raise RemoteError(f"GET {base}/v1/models: {type(e).__name__}: {e}") from e
    except (ValueError, AttributeError, TypeError) as e:
        raise RemoteError(f"GET {base}/v1/models: unexpected response ({e})") from e
    if not entries:
        raise RemoteError(f"GET {base}/v1/models: no models listed; pass the model name")
    return entries


def server_version(base: str, headers: dict, timeout_s: float, client: httpx.Client) -> str | None:
    """The version a server reports: vLLM's and SGLang's ``GET /version``, llama-server's ``/props``
    (``build_info``); None where it reports none."""
    for path, key in (("/version", "version"), ("/props", "build_info")):
        try:
            r = client.get(base + path, headers=headers, timeout=timeout_s)
            value = r.json().get(key) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if isinstance(value, str | int | float) and str(value):
            return str(value)
    return None


def list_models(endpoint: str, api_key: str | None = None, timeout_s: float = 30.0,
                client: httpx.Client | None = None) -> list[str]:
    """The model ids served at ``endpoint`` (``GET /v1/models``); raises :class:`RemoteError`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    try:
        return [m["id"] for m in _model_entries(normalize_endpoint(endpoint), headers, timeout_s, client)]
    finally:
        if own:
            client.close()


# ``owned_by`` in /v1/models, as each server writes it (read from their sources): the only
# portable signature; llama-cpp-python's "me" comes with an empty "permissions" list.
_OWNED_BY = {"llamacpp": "llama.cpp", "vllm": "vllm", "sglang": "sglang", "specdecode": "specdecode"}


def identify_server(entry: dict) -> str | None:
    """The server software behind a ``/v1/models`` entry, when it is one we know."""
    owner = entry.get("owned_by")
    if owner == "me" and "permissions" in entry:
        return "llama-cpp-python"
    return _OWNED_BY.get(owner) if isinstance(owner, str) else None


def short_model_id(model: str, width: int = 40) -> str:
    """A model id short enough for a table: a file path (llama-cpp-python and llama.cpp report
    the GGUF's path) becomes its file name; a longer id loses its middle. Hub ids stay whole."""
    name = model
    if model.startswith(("/", "~", "./", "../")) or model.lower().endswith(".gguf"):
        name = model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or model
    if len(name) <= width:
        return name
    head = (width - 3) // 2
    return name[:head] + "..." + name[-(width - 3 - head):]


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
    server = version = None
    try:
        try:
            entries = _model_entries(base, headers, min(timeout_s, 30.0), client)
        except RemoteError:
            if model is None:  # nothing to request
                raise
            entries = []  # the model is named: a server without /v1/models can still be measured
        if model is None:
            model = entries[0]["id"]
        server = next((identify_server(e) for e in entries if e["id"] == model), None)
        version = server_version(base, headers, min(timeout_s, 30.0), client)
        for _ in range(warmup):
            if prompts:
                w = RequestResult("warmup", "warmup")
                stream_one(client, url, _request_body(prompts[0], 0, api, model, min(max_new_tokens, 16),
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
            stream_one(client, url, body, headers, api, timeout_s, results[i], t_run)
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
                     server_spec_reason=reason, server=server, server_version=version)


# ---------------------------------------------------------------------------------------------
# aggregates


def likely_causes(run: RemoteRun) -> list[str]:
    """For failures with a known cause on a known server, what happened and the flag that changes it;
    and how the tokens were counted when the server reported no usage."""
    failed = [r for r in run.results if not r.ok]
    hints = []
    cut = sum(1 for r in failed if r.error and CUT_SHORT in r.error)
    if cut and run.server == "llama-cpp-python":
        hints.append(f"{cut} stream(s) cut short: llama-cpp-python's server ends a running stream with [DONE] as soon "
                     "as another request arrives (its default interrupt_requests=True); start it with "
                     "`--interrupt_requests False` to queue concurrent requests, or measure at --concurrency 1")
    elif cut:
        hints.append(f"{cut} stream(s) cut short with no finish_reason: the server stopped them (a server that "
                     "interrupts a stream when another request arrives, a restart, a proxy timeout)")
    full = sum(1 for r in failed if r.status in (429, 503))
    if full:
        hints.append(f"{full} request(s) refused as over capacity (HTTP 429/503): lower --concurrency or give the "
                     "server more slots")
    missing = sum(1 for r in failed if r.status == 404)
    if missing:
        hints.append(f"{missing} request(s) got HTTP 404: check the URL and --endpoint-model (GET /v1/models lists "
                     "the served ids)")
    if any(r.ok and r.tokens_source == "chunks" for r in run.results):
        who = f"{run.server} ignores" if run.server else "the server ignored"
        hints.append(f"token counts are content chunks: {who} stream_options.include_usage, so a chunk that carries "
                     "several tokens counts as one")
    return hints


def summarize_run(run: RemoteRun) -> dict:
    """Per-run aggregate; see the module doc for the keys."""
    good = [r for r in run.results if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    tpots = [r.tpot_s for r in good if r.tpot_s is not None]
    itls = [x for r in good for x in r.itl_s]
    speeds = [r.tok_per_s for r in good if r.tok_per_s is not None]
    sources = {r.tokens_source for r in good}
    cached = [r.cached_tokens for r in good if r.cached_tokens is not None]
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
        # a prefix cache is a hidden variable of every serving comparison: what each server reused, when it says
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in good),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "server_spec": run.server_spec, "server_spec_reason": run.server_spec_reason,
        "server": run.server, "model": run.model, "hints": likely_causes(run),
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
