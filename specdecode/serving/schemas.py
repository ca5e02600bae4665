"""Request bodies (strict pydantic models of OpenAI's completions and chat completions),
their validation into OpenAI-shaped 400s, and their translation into ``GenerateOptions``."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdecode.core.requests import GenerateOptions
from specdecode.core.sampling import SamplingParams
from specdecode.serving.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
# Below this a temperature is greedy: logits / 1e-30 overflow to inf and sampling would fail.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 4  # OpenAI's limit; each string costs work on every chunk
MAX_STOP_CHARS = 256
# Fields that change what a response means; accepting and ignoring them would be a silent lie.
UNSUPPORTED_FIELDS = ("logprobs", "top_logprobs", "logit_bias", "echo", "suffix", "tools", "functions",
                      "frequency_penalty", "presence_penalty")


class _Body(BaseModel):
    # Strict: "5" is not an integer and 1 is not true. Unknown fields are allowed (clients
    # send many optional ones) and checked against UNSUPPORTED_FIELDS.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationBody(_Body):
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
    return_token_ids: bool | None = None  # vLLM's extension: each choice carries its token ids


class CompletionBody(GenerationBody):
    prompt: str | list[int]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


def _is_field_name(part: Any) -> bool:
    """True for a field name in a pydantic error location, False for a union tag such
    as 'str' or 'list[TextPart]' (tags name types, which our fields never do)."""
    return isinstance(part, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", part) is not None \
        and part not in {"str", "int", "float", "bool", "none"}


def schema_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({errors[0]['msg']})", code="invalid_json")
    # Of the alternatives a union reports, the deepest location is the most specific, and
    # a broken constraint says more than "wrong type" from a branch the client did not mean.
    err = max(errors, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    path = _field_path(err)
    if not path:
        return APIError(400, f"the request body must be a JSON object ({err['msg']})")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    msg = err["msg"]
    # a value of none of a union's types (stop: 5): say every type the field takes, not the first
    kinds = [x["msg"] for x in errors if _field_path(x) == path and x["type"].endswith("_type")]
    if err["type"].endswith("_type") and len(kinds) > 1:
        msg = kinds[0] + "".join(" or " + k.removeprefix("Input should be ") for k in kinds[1:])
    return APIError(400, f"invalid '{param}': {msg}", param=param)


def _field_path(err: Any) -> list[int | str]:
    return [p for p in err["loc"] if isinstance(p, int) or _is_field_name(p)]


def validate_body(body: bytes, schema: type[GenerationBody], model_name: str) -> GenerationBody:
    """The parsed body, or the APIError a client gets: bad JSON or fields, another model,
    a field this server does not support, n or best_of other than 1, an overlong stop string."""
    try:
        req = schema.model_validate_json(body)
    except ValidationError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as u:  # UTF-16, Latin-1, binary: say the encoding, not "expected value"
            raise APIError(400, f"the request body is not UTF-8 (byte 0x{body[u.start]:02x} at offset {u.start}): "
                                "send JSON encoded as UTF-8", code="invalid_json") from None
        raise schema_error(e) from None
    if req.model != model_name:
        raise APIError(404, f"the model '{req.model[:200]}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    for name in UNSUPPORTED_FIELDS:
        if (req.model_extra or {}).get(name) not in (None, False, 0, "", [], {}):
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")
    fmt = (req.model_extra or {}).get("response_format")
    if fmt is not None and fmt != {"type": "text"}:  # json_object / json_schema: a promise of JSON we cannot keep
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise APIError(400, f"response_format {kind!r} is not supported by this server: it generates free text "
                            "(drop the field, or send {\"type\": \"text\"})", param="response_format",
                       code="unsupported")
    for name in ("n", "best_of"):
        if getattr(req, name) not in (None, 1):
            raise APIError(400, f"only {name}=1 is supported, got {getattr(req, name)}", param=name)
    if any(len(s) > MAX_STOP_CHARS for s in stop_strings(req)):
        raise APIError(400, f"stop strings may have at most {MAX_STOP_CHARS} characters", param="stop")
    return req


def stop_strings(req: GenerationBody) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


def generate_options(req: GenerationBody, max_new_tokens: int) -> GenerateOptions:
    temperature = 1.0 if req.temperature is None else req.temperature
    sampling = SamplingParams(0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
                              max(req.top_k or 0, 0), 1.0 if req.top_p is None else req.top_p, req.seed)
    return GenerateOptions(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop_strings(req))
