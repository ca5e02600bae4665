"""Requests -> jobs: the server's state, reading a body within its limit, prompts and token
budgets checked against the model, and the one handler behind both generation routes.
Client errors are answered before a stream opens, in OpenAI's error shape."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from specdecode.io.errors import ModelLoadError
from specdecode.io.tokenizer import Tokenizer
from specdecode.serving.errors import APIError, client_gone
from specdecode.serving.metrics import Metrics
from specdecode.serving.responses import COUNT_KEY, JobStream, Shape, collect, stream_events, wait_started
from specdecode.serving.scheduler import Scheduler
from specdecode.serving.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionBody,
    CompletionBody,
    generate_options,
    validate_body,
)


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
        raise client_gone() from None
    return bytes(body)


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


async def generate(request: Request, state: ServerState, chat: bool) -> JSONResponse | JobStream:
    """POST /v1/chat/completions (``chat``) or /v1/completions: a JSON response or an SSE stream."""
    body = await _read_body(request, state.max_body_bytes)
    req = validate_body(body, ChatCompletionBody if chat else CompletionBody, state.model_name)
    requested: int | None
    if isinstance(req, ChatCompletionBody):
        prompt_ids, prompt_param = _chat_prompt(req, state), "messages"
        if req.max_completion_tokens is not None:
            requested, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = req.max_tokens, "max_tokens"
        default = None
    else:
        assert isinstance(req, CompletionBody)
        prompt_ids, prompt_param = _completion_prompt(req, state), "prompt"
        requested, param, default = req.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
    budget = _max_new_tokens(requested, param, len(prompt_ids), prompt_param, state, default)
    job = state.scheduler.submit(prompt_ids, generate_options(req, budget))
    shape = Shape.new(chat, state.model_name)
    ids = bool(req.return_token_ids)
    if req.stream:
        await wait_started(state.scheduler, job, request.receive)  # refused while queued: its status, not a 200
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = stream_events(job, shape, include_usage, ids, request.scope.get(COUNT_KEY, lambda status: None))
        return JobStream(events, lambda: state.scheduler.cancel(job))
    return JSONResponse(await collect(state.scheduler, job, shape, request.receive, ids))
