"""Remote mode of the bench harness: measure any OpenAI-compatible server over streaming.

The harness sends each prompt as one streaming request (``stream: true`` with
``stream_options: {"include_usage": true}``), reads the server-sent events itself, and times
every request on the client side. It also reads the server's own speculative-decoding
metrics before and after the run and reports the difference.

Public API
----------
``measure_endpoint(endpoint, prompts, *, model=None, max_new_tokens=128, concurrency=1,
api="chat", api_key=None, temperature=0.0, timeout_s=300, warmup=0, extra_body=None,
on_done=None) -> RemoteRun``
    ``endpoint``: the server root (``http://host:8000``); a trailing ``/v1``,
    ``/v1/chat/completions`` or ``/v1/completions`` is accepted and stripped.
    ``prompts``: :class:`specdecode.io.prompts.Prompt` objects (``id``, ``category``,
    ``messages`` or ``text``) or plain strings (ids ``"0"``, ``"1"``..., category
    ``"default"``). ``api="chat"`` posts ``messages`` to ``/v1/chat/completions`` (a
    text-only prompt becomes one user message); ``api="completions"`` posts ``prompt`` to
    ``/v1/completions`` (a chat prompt sends its message contents joined by blank lines, no
    template). ``model=None`` asks ``GET /v1/models`` and takes the first id.
    ``concurrency`` requests are in flight at once (a closed loop: a new request starts when
    one finishes), on threads sharing one ``httpx.Client``. ``warmup`` untimed requests
    (the first prompt, at most 16 tokens) go before the measured run. ``extra_body`` is
    merged into every request body (e.g. ``{"ignore_eos": True}`` for vLLM/SGLang).
    ``on_done(result)`` is called on the calling thread as each request finishes (e.g. to
    advance a progress bar; an exception it raises cancels the requests not yet started and
    propagates). A failed request (HTTP error, connection error, stream cut
    short, ``error`` event, empty output, ``timeout_s`` exceeded) never raises: it is
    recorded with ``ok=False`` and the reason. Only a failed model look-up (``model=None``
    and no usable ``/v1/models``) raises :class:`RemoteError`, before anything is timed.

:class:`RemoteRun` (what ``measure_endpoint`` returns)
    ``endpoint`` (normalised root), ``api``, ``model``, ``max_new_tokens``, ``concurrency``,
    ``temperature``, ``started_at`` (Unix time), ``wall_s`` (first request sent to last one
    finished), ``results`` (one :class:`RequestResult` per prompt, in prompt order),
    ``server_spec`` (dict or ``None``), ``server_spec_reason`` (why it is ``None``), and
    the methods ``summary()`` (= :func:`summarize_run`), ``records(method, run)``
    (= :func:`to_records`) and ``to_dict()`` (JSON-ready: summary, server metrics, every
    request).

:class:`RequestResult` (one request)
    ``prompt_id``, ``category``, ``ok``, ``error`` (message or ``None``), ``status`` (HTTP
    status, ``None`` when no response came), ``start_s``/``end_s`` (seconds since the run
    started), ``latency_s`` (end to end), ``ttft_s`` (to the first chunk with non-empty
    content; a role-only first chunk does not count), ``itl_s`` (gaps between successive
    content chunks), ``tpot_s`` = (latency - TTFT) / (completion tokens - 1),
    ``completion_tokens`` and ``tokens_source`` (``"usage"`` when the server reported usage,
    else ``"chunks"``: content chunks counted, which undercounts a server that packs several
    tokens, e.g. a whole accepted draft, into one chunk), ``prompt_tokens`` (from usage, or
    ``None``), ``content_chunks``, ``text``, ``reasoning`` (``reasoning_content``/``reasoning``
    deltas, counted as content for timing), ``finish_reason``, ``tok_per_s`` = completion
    tokens / latency, and ``itl_summary()`` (median/p90/p99 in seconds).

:func:`summarize_run(run) -> dict`
    ``requests``, ``ok``, ``failed``, ``errors`` (message -> count), ``wall_s``,
    ``completion_tokens`` (sum over successful requests), ``output_tok_per_s`` (that sum /
    ``wall_s``: the server's aggregate throughput), ``request_tok_per_s_median``,
    ``latency_ms_median``, ``ttft_ms_median``/``_p90``/``_p99``, ``tpot_ms_median``,
    ``itl_ms_median``/``_p90``/``_p99`` (over all gaps of all successful requests pooled),
    ``tokens_source`` (``usage``, ``chunks`` or ``mixed``), ``server_spec`` and
    ``server_spec_reason``. Latency statistics are ``None`` when no request succeeded.

:func:`to_records(run, method="remote", run_index=0) -> list[dict]`
    One dict per *successful* request shaped like :func:`specdecode.bench.harness.run_interleaved`'s
    records (``method``, ``run``, ``prompt_id``, ``category``, ``prompt_tokens``,
    ``num_tokens``, ``token_ids`` (always ``[]``: the server sends text), ``elapsed_s``,
    ``ttft_s``, ``tok_per_s``) plus ``tpot_s``, ``itl_median_s``, ``tokens_source`` and
    ``text``, so ``bench.summarize`` can consume them. Since ``token_ids`` is empty,
    ``summarize``'s ``outputs_match_baseline`` is meaningless between two remote methods
    (compare ``text`` instead).

Server speculative metrics (``server_spec``), read from the first source that has them:

* ours, Prometheus text at ``GET /metrics``: ``specdecode_spec_cycles_total``,
  ``specdecode_spec_draft_tokens_total``, ``specdecode_spec_accepted_tokens_total`` and
  ``specdecode_spec_accepted_per_position_total{position="1"}``... (1-based).
* vLLM, ``GET /metrics``: ``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``
  and ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``... (0-based);
  samples are summed over other labels (``model_name``, ``engine``).
* SGLang, ``GET /get_server_info`` (then ``/server_info``): ``avg_spec_accept_length`` at the
  top level or in ``internal_states[*]`` (averaged over data-parallel ranks). It is a gauge
  (a recent running average), so the value after the run is reported, not a difference.

For the counter sources the dict holds ``source`` (``"specdecode"`` or ``"vllm"``),
``cycles`` (verify steps / drafts), ``draft_tokens``, ``accepted_tokens`` (run deltas),
``accept_length`` = 1 + accepted / cycles, ``accept_rate`` = accepted / drafted and
``per_position`` (acceptance per cycle at draft position 1, 2, ...: index 0 is the first
draft token for both sources); the rates are ``None`` when no cycle ran (or, for
``accept_length``/``per_position``, when the server has no cycle counter). A ``note`` key
appears when there was no snapshot before the run (totals since server start). For SGLang:
``source="sglang"``, ``accept_length`` (after) and ``accept_length_before``. Counters are
server-wide: other clients' traffic during the run is counted too. ``server_spec`` is
``None`` when no source is available, and ``server_spec_reason`` says what was tried.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Literal

import httpx

from specdecode.io.prometheus import Sample, parse_prometheus

__all__ = [
    "RemoteError", "RequestResult", "RemoteRun", "measure_endpoint", "summarize_run", "to_records",
    "normalize_endpoint", "list_models", "SSEDecoder", "parse_prometheus", "read_spec_snapshot",
    "spec_delta", "percentile",
]

Api = Literal["chat", "completions"]


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


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100), as numpy's default; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# server-sent events


class SSEDecoder:
    """Turns the lines of an SSE stream into ``(event, data)`` pairs.

    Follows the SSE format (``data:`` lines joined by newlines, dispatched at a blank line;
    ``:`` comments, ``id:``/``retry:`` ignored; ``event:`` names the next event) but also
    dispatches as soon as the data collected so far is complete JSON or ``[DONE]``, so a
    server that omits the blank lines is neither mis-parsed nor timed late.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

    def _ready(self) -> bool:
        text = "\n".join(self._data)
        if text.strip() == "[DONE]":
            return True
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    def _dispatch(self) -> list[tuple[str, str]]:
        out = [(self._event or "message", "\n".join(self._data))] if self._data else []
        self._data, self._event = [], ""
        return out

    def feed(self, line: str) -> list[tuple[str, str]]:
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return []
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            return self._dispatch() if self._ready() else []
        if name == "event":
            out = self._dispatch() if self._data else []  # a new event starts: flush the last one
            self._event = value
            return out
        return []  # id:, retry:, unknown fields

    def flush(self) -> list[tuple[str, str]]:
        return self._dispatch()


# ---------------------------------------------------------------------------------------------
# Prometheus text format


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


COUNTER_SOURCES = {
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
    values = [s.get("avg_spec_accept_length") for s in info.get("internal_states") or []
              if isinstance(s, dict)]
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
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


# ---------------------------------------------------------------------------------------------
# one request


@dataclass
class RequestResult:
    prompt_id: str
    category: str
    ok: bool = False
    error: str | None = None
    status: int | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    completion_tokens: int = 0
    tokens_source: str = "chunks"
    prompt_tokens: int | None = None
    content_chunks: int = 0
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    tok_per_s: float | None = None

    def itl_summary(self) -> dict:
        return {"median": _median(self.itl_s), "p90": percentile(self.itl_s, 90),
                "p99": percentile(self.itl_s, 99)}


def _prompt_fields(prompt, index: int) -> tuple[str, str, list[dict] | None, str | None]:
    if isinstance(prompt, str):
        return str(index), "default", None, prompt
    messages = getattr(prompt, "messages", None)
    return (str(getattr(prompt, "id", index)), str(getattr(prompt, "category", "default")),
            list(messages) if messages is not None else None, getattr(prompt, "text", None))


def _request_body(prompt, index: int, api: Api, model: str, max_new_tokens: int, temperature: float,
                  extra_body: dict | None) -> dict:
    _, _, messages, text = _prompt_fields(prompt, index)
    body: dict = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = messages if messages is not None else [{"role": "user", "content": text or ""}]
    else:
        body["prompt"] = text if text is not None else "\n\n".join(
            str(m.get("content", "")) for m in messages or [])
    return body | (extra_body or {})


def _error_message(payload) -> str:
    err = payload.get("error") if isinstance(payload, dict) else payload
    if isinstance(err, dict):
        err = err.get("message") or json.dumps(err)
    return str(err)[:500]


def _stream_one(client: httpx.Client, url: str, body: dict, headers: dict, api: Api, timeout_s: float,
                res: RequestResult, t_run: float) -> None:
    """Fill ``res`` from one streaming request; never raises for request-level failures."""
    t0 = time.perf_counter()
    res.start_s = t0 - t_run
    last_content: float | None = None
    usage_tokens: int | None = None
    done = False

    def handle(event: str, data: str) -> bool:
        """One SSE event; False stops the stream."""
        nonlocal last_content, usage_tokens, done
        if data.strip() == "[DONE]":
            done = True
            return False
        try:
            chunk = json.loads(data)
        except ValueError:
            res.error = f"malformed event data: {data[:200]!r}"
            return False
        if event == "error" or (isinstance(chunk, dict) and chunk.get("error") and not chunk.get("choices")):
            res.error = "server error event: " + _error_message(chunk)
            return False
        if not isinstance(chunk, dict):
            return True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                res.prompt_tokens = usage["prompt_tokens"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if api == "chat":
                delta = choice.get("delta") or {}
                content = delta.get("content") or ""
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            else:
                content, reasoning = choice.get("text") or "", ""
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
            if content or reasoning:
                now = time.perf_counter()
                if last_content is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last_content)
                last_content = now
                res.content_chunks += 1
                res.text += content
                res.reasoning += reasoning
        return True

    try:
        with client.stream("POST", url, json=body, headers=headers) as response:
            res.status = response.status_code
            if response.status_code != 200:
                detail = response.read().decode("utf-8", "replace")
                try:
                    detail = _error_message(json.loads(detail))
                except ValueError:
                    detail = detail[:300]
                res.error = f"HTTP {response.status_code}: {detail}".strip()
            else:
                decoder = SSEDecoder()
                stop = False
                for line in response.iter_lines():
                    for event, data in decoder.feed(line):
                        if not handle(event, data):
                            stop = True
                            break
                    if stop:
                        break
                    if time.perf_counter() - t0 > timeout_s:
                        res.error = f"timed out after {timeout_s:g} s"
                        break
                else:
                    for event, data in decoder.flush():
                        if not handle(event, data):
                            break
    except httpx.TimeoutException as e:
        res.error = f"timed out ({type(e).__name__})"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except Exception as e:  # noqa: BLE001 - a request's failure must not end the run
        res.error = f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    res.end_s = t1 - t_run
    res.latency_s = t1 - t0
    if usage_tokens is not None:
        res.completion_tokens, res.tokens_source = usage_tokens, "usage"
    else:
        res.completion_tokens, res.tokens_source = res.content_chunks, "chunks"
    if res.error is None and not done and res.finish_reason is None:
        res.error = "stream ended before [DONE] or a finish_reason"
    if res.error is None and res.ttft_s is None:
        res.error = "no content in the response"
    res.ok = res.error is None
    if res.ok:
        if res.completion_tokens > 1:
            res.tpot_s = (res.latency_s - res.ttft_s) / (res.completion_tokens - 1)
        res.tok_per_s = res.completion_tokens / res.latency_s if res.latency_s > 0 else None


# ---------------------------------------------------------------------------------------------
# a run


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
            except Exception as e:  # noqa: BLE001 - a bad prompt fails its request, not the run
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
