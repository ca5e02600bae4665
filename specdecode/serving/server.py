"""`specdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events with ``stream: true``), ``GET /health``, ``GET /metrics`` (Prometheus).

The model is not thread-safe, so one worker thread generates for one request at a time,
taking requests first come, first served. It steps ``Engine.stream`` chunk by chunk and
hands every chunk to the request's asyncio queue (``call_soon_threadsafe``): the event
loop never waits on the model, and a request whose client went away is dropped at the
next chunk. Client errors are answered before a stream opens, in OpenAI's error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hmac
import ipaddress
import json
import logging
import os
import re
import threading
import time
import uuid
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Callable, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdecode.core.engine import Engine, GenerateOptions, StreamChunk, TokenDecoder
from specdecode.core.profiler import PHASES, SpecProfile
from specdecode.core.sampling import SamplingParams
from specdecode.io.errors import ModelLoadError
from specdecode.io.loading import LoadedModel
from specdecode.io.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUED = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
# Below this a temperature is greedy: logits / 1e-30 overflow to inf and sampling would fail.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 4  # OpenAI's limit; each string costs work on every chunk
MAX_STOP_CHARS = 256
# Fields that change what a response means; accepting and ignoring them would be a silent lie.
UNSUPPORTED_FIELDS = ("logprobs", "top_logprobs", "logit_bias", "echo", "suffix", "tools", "functions",
                      "frequency_penalty", "presence_penalty")
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ---------------------------------------------------------------- errors

class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` (OpenAI's shape)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _client_gone() -> APIError:
    # 499 (nginx's "client closed request"): nobody reads it, but /metrics counts it.
    return APIError(499, "the client closed the request", code="client_closed_request")


# ---------------------------------------------------------------- request bodies

class _Body(BaseModel):
    # Strict: "5" is not an integer and 1 is not true. Unknown fields are allowed (clients
    # send many optional ones) and checked against UNSUPPORTED_FIELDS.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; 0 and -1 mean off
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)  # what torch.Generator accepts
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class CompletionBody(_GenerationBody):
    prompt: str | list[int]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


def _is_field_name(part: Any) -> bool:
    """True for a field name in a pydantic error location, False for a union tag such
    as 'str' or 'list[TextPart]' (tags name types, which our fields never do)."""
    return isinstance(part, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", part) is not None \
        and part not in {"str", "int", "float", "bool", "none"}


def _schema_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({errors[0]['msg']})", code="invalid_json")
    # Of the alternatives a union reports, the deepest location is the most specific, and
    # a broken constraint says more than "wrong type" from a branch the client did not mean.
    err = max(errors, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    path = [p for p in err["loc"] if isinstance(p, int) or _is_field_name(p)]
    if not path:
        return APIError(400, f"the request body must be a JSON object ({err['msg']})")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return APIError(400, f"invalid '{param}': {err['msg']}", param=param)


# ---------------------------------------------------------------- metrics

class Histogram:
    """A Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {total}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


def _number(x: float) -> str:
    return "+Inf" if x == float("inf") else repr(x) if isinstance(x, float) else str(x)


@dataclass
class _SharedProfile(SpecProfile):
    """The server-wide SpecProfile: the worker adds cycles while /metrics reads it."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, record) -> None:
        with self.lock:
            super().add(record)


@dataclass(frozen=True)
class _Snapshot:
    time: float
    generated: int
    cycles: int
    drafted: int
    accepted: int


class Metrics:
    """Counters and histograms, updated by the worker thread and the event loop alike."""

    def __init__(self, max_depth: int) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(PER_TOKEN_BUCKETS)
        self.spec = _SharedProfile(lock=self.lock)
        self.max_depth = max_depth  # the deepest draft position a cycle can accept

    def count_request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[route, status] += 1

    def count_prompt(self, tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += tokens

    def count_tokens(self, tokens: int, ttft: float | None, per_token: float | None) -> None:
        with self.lock:
            self.generated_tokens += tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            if per_token is not None:
                self.per_token.observe(per_token, tokens)

    def snapshot(self) -> _Snapshot:
        with self.lock:
            s = self.spec
            return _Snapshot(time.perf_counter(), self.generated_tokens, s.cycles, s.drafted, s.accepted)

    def render(self, running: int, queued: int) -> str:
        with self.lock:
            lines = self._render(running, queued)
        return "\n".join(lines) + "\n"

    def _render(self, running: int, queued: int) -> list[str]:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        metric("specdecode_requests_total", "counter", "HTTP requests by route and status.",
               [f'specdecode_requests_total{{route="{r}",status="{s}"}} {n}'
                for (r, s), n in sorted(self.requests.items())])
        metric("specdecode_requests_running", "gauge", "Requests generating now (at most 1).",
               [f"specdecode_requests_running {running}"])
        metric("specdecode_requests_queued", "gauge", "Requests waiting for the worker.",
               [f"specdecode_requests_queued {queued}"])
        metric("specdecode_prompt_tokens_total", "counter", "Prompt tokens of requests started.",
               [f"specdecode_prompt_tokens_total {self.prompt_tokens}"])
        metric("specdecode_generation_tokens_total", "counter", "Tokens generated (stop tokens included).",
               [f"specdecode_generation_tokens_total {self.generated_tokens}"])
        metric("specdecode_time_to_first_token_seconds", "histogram",
               "From request accepted (queue wait included) to its first token.",
               self.ttft.lines("specdecode_time_to_first_token_seconds"))
        metric("specdecode_time_per_output_token_seconds", "histogram",
               "Time per token after the first (a chunk's wait divided among its tokens).",
               self.per_token.lines("specdecode_time_per_output_token_seconds"))
        s = self.spec
        metric("specdecode_spec_cycles_total", "counter", "Speculative draft-verify cycles.",
               [f"specdecode_spec_cycles_total {s.cycles}"])
        metric("specdecode_spec_draft_tokens_total", "counter", "Draft tokens verified by the target.",
               [f"specdecode_spec_draft_tokens_total {s.drafted}"])
        metric("specdecode_spec_accepted_tokens_total", "counter",
               "Draft tokens accepted (bonus tokens not included); accept length = 1 + accepted / cycles.",
               [f"specdecode_spec_accepted_tokens_total {s.accepted}"])
        depth = max(self.max_depth, max(s.depth_hist, default=0))
        metric("specdecode_spec_accepted_per_position_total", "counter",
               "Cycles whose accepted path reached draft position N (1-based).",
               [f'specdecode_spec_accepted_per_position_total{{position="{i}"}} '
                f'{sum(c for a, c in s.depth_hist.items() if a >= i)}' for i in range(1, depth + 1)])
        metric("specdecode_spec_phase_seconds_total", "counter", "Seconds spent in each phase of the cycles.",
               [f'specdecode_spec_phase_seconds_total{{phase="{p}"}} {_number(float(s.phase_s.get(p, 0.0)))}'
                for p in PHASES])
        return out


def decode_log_line(before: _Snapshot, after: _Snapshot, running: int, queued: int) -> str:
    """The periodic decode summary over the interval between two snapshots."""
    seconds = max(after.time - before.time, 1e-9)
    cycles, drafted = after.cycles - before.cycles, after.drafted - before.drafted
    accepted = after.accepted - before.accepted
    spec = (f"accept len {1 + accepted / cycles:.2f}, accept rate {accepted / drafted:.2f}, "
            if cycles and drafted else "")
    return (f"decode: {spec}gen throughput {(after.generated - before.generated) / seconds:.1f} tok/s, "
            f"running {running}, queued {queued}")


# ---------------------------------------------------------------- the worker

_END = object()  # the last event of every job


@dataclass(eq=False)  # identity equality: jobs are removed from the queue by identity
class Job:
    """One generation: the worker posts StreamChunks, maybe an APIError, then _END to ``events``."""

    prompt_ids: list[int]
    options: GenerateOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    accepted_at: float = field(default_factory=time.perf_counter)

    def post(self, event: object) -> None:
        """Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        while (event := await self.events.get()) is not _END:
            if isinstance(event, APIError):
                raise event
            yield event


class Scheduler:
    """One worker thread, a FIFO of waiting jobs, and the shutdown sequence."""

    def __init__(self, engine: Engine, metrics: Metrics, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued = max_queued
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._work, name="specdecode-worker", daemon=True)

    @property
    def closing(self) -> bool:
        return self._closing

    def load(self) -> tuple[int, int]:
        """(running, queued)."""
        return int(self._running is not None), len(self._waiting)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, prompt_ids: list[int], options: GenerateOptions) -> Job:
        job = Job(prompt_ids, options, asyncio.get_running_loop())
        with self._cv:
            if self._closing:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self._waiting) >= self.max_queued:
                raise APIError(503, f"the server is overloaded ({len(self._waiting)} requests queued); retry later",
                               type="server_error", code="overloaded")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job: taken off the queue, or stopped by the worker at its next chunk."""
        job.cancelled.set()
        with self._cv:
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)

    def close(self) -> None:
        """Take no new jobs and fail the waiting ones; the running one finishes."""
        with self._cv:
            self._closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        for job in dropped:
            job.post(APIError(503, "the server is shutting down; the request was not started",
                              type="server_error", code="shutting_down"))
            job.post(_END)

    def close_soon(self) -> None:
        """``close`` from any thread, signal handlers included (they must not take locks)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cv:
            while not self._waiting and not self._closing:
                self._cv.wait()
            if not self._waiting:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _work(self) -> None:
        while (job := self._next()) is not None:
            if not job.cancelled.is_set():  # else its client left while it waited: skip the prefill
                self._generate(job)
            with self._cv:
                self._running = None
            job.post(_END)  # after the bookkeeping: a client that saw its end finds the worker idle

    def _generate(self, job: Job) -> None:
        self.metrics.count_prompt(len(job.prompt_ids))
        stream = self.engine.stream(job.prompt_ids, job.options, self.metrics.spec)
        last = None  # when the previous tokens came
        try:
            for chunk in stream:
                if job.cancelled.is_set():
                    return
                if chunk.token_ids:
                    now = time.perf_counter()
                    per_token = None if last is None else (now - last) / len(chunk.token_ids)
                    ttft = now - job.accepted_at if last is None else None
                    self.metrics.count_tokens(len(chunk.token_ids), ttft, per_token)
                    last = now
                job.post(chunk)  # after counting, so /metrics never lags what a client saw
        except Exception:  # a bug or a device failure: this request fails, the server goes on
            log.exception("generation failed")
            job.post(APIError(500, "generation failed; see the server log", type="server_error"))
        finally:
            stream.close()


# ---------------------------------------------------------------- response shapes

@dataclass(frozen=True)
class _Shape:
    """OpenAI's objects for one response: chat completion or text completion."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> _Shape:
        return cls(chat, model, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()))

    def _object(self, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def full(self, text: str, finish: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return self._object("chat.completion", [choice], usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._object("text_completion", [choice], usage)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._object("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream_events(job: Job, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    tokens = 0
    try:
        if shape.chat:
            yield _sse(shape.chunk(role=True))
        async for chunk in job.chunks():
            tokens += len(chunk.token_ids)
            if chunk.text:
                yield _sse(shape.chunk(chunk.text))
            if chunk.finish_reason:
                yield _sse(shape.chunk(finish=chunk.finish_reason))
        if include_usage:
            yield _sse(shape.usage_chunk(_usage(len(job.prompt_ids), tokens)))
        yield "data: [DONE]\n\n"
    except APIError as e:  # the status line is already sent: report in-band, as OpenAI does
        yield _sse(e.body())


class _JobStream(StreamingResponse):
    """A stream that cancels its job however the response ends, even when the client
    left before the body iterator ever started (then no ``finally`` inside it runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _cancel_on_disconnect(scheduler: Scheduler, job: Job, receive) -> None:
    # After the body is read, receive() returns only when the client disconnects.
    while (await receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(job)
    job.events.put_nowait(_client_gone())


async def _collect(scheduler: Scheduler, job: Job, shape: _Shape, receive) -> dict:
    watcher = asyncio.ensure_future(_cancel_on_disconnect(scheduler, job, receive))
    parts, tokens, finish = [], 0, "length"
    try:
        async for chunk in job.chunks():
            parts.append(chunk.text)
            tokens += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
    finally:
        watcher.cancel()
        scheduler.cancel(job)
    return shape.full("".join(parts), finish, _usage(len(job.prompt_ids), tokens))


# ---------------------------------------------------------------- requests -> jobs

@dataclass
class ServerState:
    scheduler: Scheduler
    metrics: Metrics
    tokenizer: Tokenizer  # the event loop's own copy (the worker decodes with the engine's)
    model_name: str
    vocab_size: int
    context: int  # the model's context in tokens
    margin: int  # cache slots a speculative decoder needs beyond the new tokens
    api_key: str | None
    max_body_bytes: int
    started: int = field(default_factory=lambda: int(time.time()))


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {int(declared)} bytes; the limit is {limit}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:  # chunked bodies declare no length
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:
        raise _client_gone() from None
    return bytes(body)


async def _parse(request: Request, state: ServerState, schema: type[_GenerationBody]) -> _GenerationBody:
    body = await _read_body(request, state.max_body_bytes)
    try:
        req = schema.model_validate_json(body)
    except ValidationError as e:
        raise _schema_error(e) from None
    if req.model != state.model_name:
        raise APIError(404, f"the model '{req.model[:200]}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")
    for name in UNSUPPORTED_FIELDS:
        if (req.model_extra or {}).get(name) not in (None, False, 0, "", [], {}):
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
    for name in ("n", "best_of"):
        if getattr(req, name) not in (None, 1):
            raise APIError(400, f"only {name}=1 is supported, got {getattr(req, name)}", param=name)
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop strings may have at most {MAX_STOP_CHARS} characters", param="stop")
    return req


def _completion_prompt(req: CompletionBody, state: ServerState) -> list[int]:
    if isinstance(req.prompt, str):
        return state.tokenizer.encode(req.prompt)
    bad = next((t for t in req.prompt if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                       param="prompt")
    return list(req.prompt)


def _chat_prompt(req: ChatCompletionBody, state: ServerState) -> list[int]:
    from jinja2 import TemplateError

    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    try:
        return state.tokenizer.encode_chat(messages)
    except ModelLoadError as e:  # no chat template
        raise APIError(400, f"{e}; use /v1/completions", param="messages") from None
    except TemplateError as e:  # templates may reject e.g. an order of roles
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None


def _max_new_tokens(requested: int | None, param: str, prompt_len: int, prompt_param: str,
                    state: ServerState, default: int | None) -> int:
    """The token budget, or a 400 with the numbers when it does not fit the context."""
    if prompt_len < 1:
        raise APIError(400, "the prompt is empty: at least one token is needed", param=prompt_param)
    room = state.context - state.margin - prompt_len  # new tokens that fit
    if room < 1:  # whatever max_tokens says
        reserved = f" and {state.margin} slots for speculative decoding" if state.margin else ""
        raise APIError(400, f"the prompt has {prompt_len} tokens, too many for this model's maximum context length "
                            f"of {state.context} tokens with at least 1 new token{reserved}",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        requested = room if default is None else min(default, room)
    if requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        reserved = f", {state.margin} reserved for speculative decoding" if state.margin else ""
        raise APIError(
            400, f"this model's maximum context length is {state.context} tokens, but "
                 f"{prompt_len + requested + state.margin} were requested ({prompt_len} in the prompt, "
                 f"{requested} for the completion{reserved}); shorten the prompt or lower {param}",
            param=param, code="context_length_exceeded")
    return requested


def _options(req: _GenerationBody, max_new_tokens: int) -> GenerateOptions:
    temperature = 1.0 if req.temperature is None else req.temperature
    sampling = SamplingParams(0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
                              max(req.top_k or 0, 0), 1.0 if req.top_p is None else req.top_p, req.seed)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return GenerateOptions(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)


async def _generate(request: Request, state: ServerState, chat: bool):
    req = await _parse(request, state, ChatCompletionBody if chat else CompletionBody)
    if chat:
        prompt_ids, prompt_param = _chat_prompt(req, state), "messages"
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        default = None
    else:
        prompt_ids, prompt_param = _completion_prompt(req, state), "prompt"
        requested, param, default = req.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
    budget = _max_new_tokens(requested, param, len(prompt_ids), prompt_param, state, default)
    job = state.scheduler.submit(prompt_ids, _options(req, budget))
    shape = _Shape.new(chat, state.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _JobStream(_stream_events(job, shape, include_usage), lambda: state.scheduler.cancel(job))
    return JSONResponse(await _collect(state.scheduler, job, shape, request.receive))


# ---------------------------------------------------------------- the app

class _CountRequests:
    """ASGI middleware: requests by route and status, counted when the status is sent
    (so a client that has read a response always finds it in /metrics)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        counted = False

        async def send_counted(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.count_request(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:  # the app's catch-all answers 500 outside this middleware
            if not counted:
                self.metrics.count_request(route, 500)
            raise


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 in their error shape.
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return APIError(400, f"invalid '{param}': {err['msg']}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown routes and methods
        response = APIError(e.status_code, f"{e.detail} ({request.method} {request.url.path})").response()
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error; see the server log", type="server_error").response()


def create_app(loaded: LoadedModel, decoder: TokenDecoder, served_model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queued: int = DEFAULT_MAX_QUEUED,
               log_interval_s: float = 10.0, shutdown_wait_s: float = 10.0, engine=None) -> FastAPI:
    """The FastAPI app around one model and decoder; the worker starts with the app's lifespan.
    ``engine``: anything with ``Engine.stream``'s signature to use instead (tensor parallel
    serving passes rank 0's ``tp.MirroredEngine``)."""
    model = loaded.model
    spec_config = getattr(decoder, "config", None)
    metrics = Metrics(max_depth=getattr(decoder, "max_depth", 0))
    state = ServerState(
        scheduler=Scheduler(engine or Engine(model, loaded.tokenizer, decoder), metrics, max_queued),
        metrics=metrics,
        # Request parsing runs on the event loop while the worker decodes: separate
        # tokenizer objects keep the two threads from sharing one Rust tokenizer.
        tokenizer=copy.deepcopy(loaded.tokenizer),
        model_name=served_model_name,
        vocab_size=model.config.vocab_size,
        context=model.config.max_position_embeddings,
        margin=getattr(spec_config, "num_draft_tokens", 0) or 0,
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        reporter = asyncio.ensure_future(_report_periodically(state, log_interval_s))
        try:
            yield
        finally:
            reporter.cancel()
            state.scheduler.close()
            await asyncio.to_thread(state.scheduler.join, shutdown_wait_s)

    # No /docs or /openapi.json: every route but /health sits behind the API key.
    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    async def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    protected = [Depends(require_key)]

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "specdecode"}

    @app.get("/health")
    async def health():
        if state.scheduler.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=protected)
    async def metrics():
        text = state.metrics.render(*state.scheduler.load())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=protected)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request):
        return await _generate(request, state, chat=False)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        return await _generate(request, state, chat=True)


async def _report_periodically(state: ServerState, interval_s: float) -> None:
    before = state.metrics.snapshot()
    while True:
        await asyncio.sleep(interval_s)
        after = state.metrics.snapshot()
        running, queued = state.scheduler.load()
        if after.generated > before.generated or running or queued:  # quiet when idle
            log.info(decode_log_line(before, after, running, queued))
        before = after


# ---------------------------------------------------------------- running it

class _GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting, waits for open requests, and only then
    runs the app's shutdown. Closing the scheduler at the signal fails queued requests
    at once (503) instead of generating them all first; the running one finishes."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.close_soon()
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout_s: float = 30.0,
                log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``create_app``'s app (port 0: any free port)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s)
    return _GracefulServer(config, app.state.server.scheduler)


def default_model_name(source: Path) -> str:
    """'smollm2-135m-instruct' for SmolLM2-135M-Instruct.Q4_1.gguf: the file or directory
    name, lower case, without a GGUF quantization suffix."""
    name = source.stem if source.suffix.lower() == ".gguf" else source.name
    return re.sub(r"[.\-_](i?q\d\w*|bf16|f16|f32)$", "", name, flags=re.IGNORECASE).lower()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it, "
                        "so set an API key)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$SPECDECODE_API_KEY, which keeps the key out of the process list; none)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: derived from the model, e.g. smollm2-135m-instruct)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-queued", type=int, default=DEFAULT_MAX_QUEUED,
                   help=f"requests waiting beyond this get 503 (default: {DEFAULT_MAX_QUEUED})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds a shutdown waits for running requests (default: 30)")
    g.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between decode summaries in the log while busy (default: 10)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from specdecode.cli.common import decoder_spec, runtime_config
    from specdecode.runtime.decoders import build_decoder
    from specdecode.runtime.session import start

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_body_bytes < 1 or args.max_queued < 0:
        raise ValueError("--max-body-bytes must be >= 1 and --max-queued >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    session = start(runtime_config(args))
    loaded, threads = session.loaded, session.threads
    built = build_decoder(decoder_spec(args), session)
    decoder, method = built.decode, built.description
    api_key = args.api_key or os.environ.get("SPECDECODE_API_KEY") or None
    name = args.served_model_name or default_model_name(loaded.source)
    if api_key is None and not _is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    from specdecode.runtime.tp import world
    from specdecode.serving.mirror import MirroredEngine, follow

    rank, ranks = world()
    engine = Engine(loaded.model, loaded.tokenizer, decoder, comm=session.comm)
    if rank > 0:  # tensor parallel: only rank 0 listens; the others mirror its jobs
        follow(engine)
        return 0
    mirrored = MirroredEngine(engine) if ranks > 1 else None
    app = create_app(loaded, decoder, name, api_key=api_key, max_body_bytes=args.max_body_bytes,
                     max_queued=args.max_queued, log_interval_s=args.log_interval, engine=mirrored)
    log.info("serving %s as '%s' with %s, %s, %d threads%s", loaded.source, name, method, args.dtype, threads,
             f", tensor parallel over {ranks} ranks" if ranks > 1 else "")
    try:
        make_server(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout).run()
    finally:
        if mirrored:
            mirrored.shutdown()
    return 0
