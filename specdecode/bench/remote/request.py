"""One streaming request: its body, the SSE stream read and timed on the client side, and
what it measured (``RequestResult``). A request's failure is recorded, never raised."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx

from specdecode.bench.remote.sse import SSEDecoder
from specdecode.bench.stats import percentile

Api = Literal["chat", "completions"]


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


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
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: the server's prefix cache hits
    chunks: int = 0  # data events received (role-only, usage-only and [DONE] included)
    content_chunks: int = 0
    done: bool = False  # the stream ended with [DONE]
    text: str = ""
    token_ids: list[int] | None = None  # when the server sends them (``return_token_ids``: ours, vLLM)
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


def _received(res: RequestResult) -> str:
    """What had arrived when a stream failed (empty before any response)."""
    if res.status is None:
        return ""
    return f" after {res.chunks} chunk(s), {res.content_chunks} with content"


CUT_SHORT = "cut short"  # in every message about a stream that ended without a finish_reason


def _incomplete(res: RequestResult) -> str | None:
    """Why a stream that ended without a transport error is not a complete response, or None.
    A complete one has a finish_reason (every OpenAI-compatible server sends one) and content."""
    if res.finish_reason is None:
        how = "with [DONE]" if res.done else "(connection closed) without [DONE]"
        return f"stream {CUT_SHORT}: it ended {how} and no finish_reason{_received(res)}"
    if res.ttft_s is None:
        return f"no content in the response (finish_reason {res.finish_reason!r}{_received(res)})"
    return None


def stream_one(client: httpx.Client, url: str, body: dict, headers: dict, api: Api, timeout_s: float,
                res: RequestResult, t_run: float) -> None:
    """Fill ``res`` from one streaming request; never raises for request-level failures."""
    t0 = time.perf_counter()
    res.start_s = t0 - t_run
    last_content: float | None = None
    usage_tokens: int | None = None

    def handle(event: str, data: str) -> bool:
        """One SSE event; False stops the stream."""
        nonlocal last_content, usage_tokens
        res.chunks += 1
        if data.strip() == "[DONE]":
            res.done = True
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
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                res.cached_tokens = details["cached_tokens"]
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
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                if res.token_ids is None:
                    res.token_ids = []
                res.token_ids.extend(int(i) for i in ids)
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
        res.error = f"timed out ({type(e).__name__})" + _received(res)
    except httpx.HTTPError as e:
        res.error = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) + _received(res)
    except Exception as e:  # a request's failure must not end the run
        res.error = f"{type(e).__name__}: {e}" + _received(res)
    t1 = time.perf_counter()
    res.end_s = t1 - t_run
    res.latency_s = t1 - t0
    if usage_tokens is not None:
        res.completion_tokens, res.tokens_source = usage_tokens, "usage"
    else:
        res.completion_tokens, res.tokens_source = res.content_chunks, "chunks"
    if res.error is None:
        res.error = _incomplete(res)
    res.ok = res.error is None
    if res.ok:
        if res.completion_tokens > 1 and res.ttft_s is not None:
            res.tpot_s = (res.latency_s - res.ttft_s) / (res.completion_tokens - 1)
        res.tok_per_s = res.completion_tokens / res.latency_s if res.latency_s > 0 else None
