"""Responses in OpenAI's shapes: whole (chat) completions, and server-sent event streams
that end in ``data: [DONE]``, after an in-band error event when one comes once the status line is sent. A stream's
status line waits until its job has joined the batch (``wait_started``), so a request refused
while it queued (shutdown: 503 with Retry-After) gets its status, not a 200 and an error event."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from specdecode.serving.errors import APIError, client_gone
from specdecode.serving.scheduler import Job, Scheduler

EVENT_STREAM = "text/event-stream"
COUNT_KEY = "specdecode.count"  # in the ASGI scope: the metrics middleware's count(status), once per request


@dataclass(frozen=True)
class Shape:
    """OpenAI's objects for one response: chat completion or text completion."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Shape:
        return cls(chat, model, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()))

    def _object(self, kind: str, choices: list[dict], usage: dict | None = None, metrics: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        if metrics:
            out["metrics"] = metrics
        return out

    def full(self, text: str, finish: str, usage: dict, token_ids: list[int] | None = None,
             metrics: dict | None = None) -> dict:
        ids = {} if token_ids is None else {"token_ids": token_ids}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish} | ids
            return self._object("chat.completion", [choice], usage, metrics)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish} | ids
        return self._object("text_completion", [choice], usage, metrics)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              token_ids: list[int] | None = None) -> dict:
        ids = {} if token_ids is None else {"token_ids": token_ids}
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish} | ids
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish} | ids
        return self._object("text_completion", [choice])

    def usage_chunk(self, usage: dict, metrics: dict | None = None) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage, metrics)


def usage_of(job: Job, completion: int) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache gave."""
    prompt = len(job.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}


def metrics_of(job: Job) -> dict | None:
    """The request's own speculative decoding, as vLLM returns it per request (its ``metrics.speculative_decoding``,
    vllm-project/vllm#48915): accept length (the bonus token counted), accepted / drafted, how many cycles
    accepted exactly j draft tokens (index j), and the counts. None where the request never speculated."""
    p = job.profile
    if p is None or not p.cycles:
        return None
    histogram = [p.depth_hist.get(j, 0) for j in range(max(p.depth_hist, default=0) + 1)]
    return {"speculative_decoding": {
        "mean_acceptance_length": p.accept_length, "draft_acceptance_rate": p.accept_rate if p.drafted else 0.0,
        "acceptance_histogram": histogram, "num_spec_steps": p.cycles, "num_accepted_draft_tokens": p.accepted,
        "num_draft_tokens": p.drafted, "num_spec_tokens": p.max_depth}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream_events(job: Job, shape: Shape, include_usage: bool, token_ids: bool = False,
                        on_end: Callable[[int], Any] = lambda status: None) -> AsyncIterator[str]:
    """``token_ids``: every chunk that brings tokens carries their ids (even when its text is held back).
    ``on_end(status)`` runs before the last event: 200, or the status of an in-band error."""
    tokens = 0
    try:
        if shape.chat:
            yield _sse(shape.chunk(role=True))
        async for chunk in job.chunks():
            tokens += len(chunk.token_ids)
            if chunk.text or (token_ids and chunk.token_ids):
                yield _sse(shape.chunk(chunk.text, token_ids=chunk.token_ids if token_ids else None))
            if chunk.finish_reason:
                yield _sse(shape.chunk(finish=chunk.finish_reason))
        on_end(200)
        if include_usage:
            yield _sse(shape.usage_chunk(usage_of(job, tokens), metrics_of(job)))
    except APIError as e:  # the status line is already sent: report in-band, as OpenAI does
        on_end(e.status)
        yield _sse(e.body())
    yield "data: [DONE]\n\n"  # after an error event too: clients that read to [DONE] stop there


class JobStream(StreamingResponse):
    """A stream that cancels its job however the response ends, even when the client
    left before the body iterator ever started (then no ``finally`` inside it runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=EVENT_STREAM,
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
    job.events.put_nowait(client_gone())


async def wait_started(scheduler: Scheduler, job: Job, receive) -> None:
    """Until ``job`` joins the batch: a client that leaves meanwhile cancels it (499); an error
    before it started is raised here, to be answered with its own status."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(scheduler, job, receive))
    try:
        await job.started()
    except BaseException:
        scheduler.cancel(job)
        raise
    finally:
        watcher.cancel()


async def collect(scheduler: Scheduler, job: Job, shape: Shape, receive, token_ids: bool = False) -> dict:
    watcher = asyncio.ensure_future(_cancel_on_disconnect(scheduler, job, receive))
    parts: list[str] = []
    ids: list[int] = []
    finish = "length"
    try:
        async for chunk in job.chunks():
            parts.append(chunk.text)
            ids += chunk.token_ids
            finish = chunk.finish_reason or finish
    finally:
        watcher.cancel()
        scheduler.cancel(job)
    return shape.full("".join(parts), finish, usage_of(job, len(ids)), ids if token_ids else None, metrics_of(job))
