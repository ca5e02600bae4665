"""Request validation (``serving/schemas.py``): schema errors are 400s naming the field, malformed
JSON or another encoding is a 400 that says so, and fuzzed bodies (objects: every 400 names a field) and
fuzzed bytes never get a 5xx."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.helpers import CHAT, COMPLETIONS, CONTEXT, MSG, NAME, error_of, post, sse_events


@pytest.mark.parametrize("path,body,param,words", [
    (CHAT, {"model": NAME}, "messages", ["Field required"]),
    (COMPLETIONS, {"model": NAME}, "prompt", ["Field required"]),
    (CHAT, {"messages": MSG}, "model", ["Field required"]),
    (CHAT, {"model": NAME, "messages": MSG, "max_tokens": "5"}, "max_tokens", ["integer"]),
    (CHAT, {"model": NAME, "messages": MSG, "stream": 1}, "stream", ["boolean"]),
    (CHAT, {"model": NAME, "messages": MSG, "temperature": 3}, "temperature", ["2"]),
    (CHAT, {"model": NAME, "messages": MSG, "top_p": 0}, "top_p", ["0"]),
    (CHAT, {"model": NAME, "messages": "hi"}, "messages", []),
    (CHAT, {"model": NAME, "messages": []}, "messages", []),
    (CHAT, {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", []),
    (CHAT, {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", []),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "stop": [1]}, "stop[0]", []),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", []),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "n": 2}, "n", ["n=1", "2"]),
    (CHAT, {"model": NAME, "messages": MSG, "n": 2}, "n", ["n=1", "2"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "logprobs": 3}, "logprobs", ["not supported"]),
    (CHAT, {"model": NAME, "messages": MSG, "response_format": {"type": "json_object"}}, "response_format",
     ["'json_object' is not supported", "free text"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "stop": 5}, "stop", ["valid string or a valid array"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens", ["at least 1", "0"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "max_tokens": -3}, "max_tokens", ["-3"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "max_tokens": 10 ** 30}, "max_tokens",
     [str(CONTEXT), str(10 ** 30)]),
    (CHAT, {"model": NAME, "messages": MSG, "max_completion_tokens": 1000}, "max_completion_tokens",
     [str(CONTEXT), "1000"]),
    (COMPLETIONS, {"model": NAME, "prompt": ""}, "prompt", ["empty"]),
    (COMPLETIONS, {"model": NAME, "prompt": [5, 10 ** 6]}, "prompt", ["1000000", "vocabulary"]),
    (COMPLETIONS, {"model": NAME, "prompt": "x", "seed": 2 ** 70}, "seed", []),
])
def test_schema_errors_are_400_naming_the_field(http, path, body, param, words):
    err = error_of(post(http, path, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for word in words:
        assert word in err["message"], err


@pytest.mark.parametrize("content,words", [
    (b"{not json", ["not valid JSON"]),
    (b"", ["not valid JSON"]),
    (b"\xff\xfe", ["not UTF-8", "0xff", "offset 0"]),
    ('{"prompt": "h\u00e9"}'.encode("latin-1"), ["not UTF-8", "0xe9", "offset 13"]),
    (b'{"prompt": "a\\ud800b"}', ["not valid JSON"]),  # a lone surrogate
    (b"[1, 2]", ["JSON object"]),
    (b"[" * 5000 + b"]" * 5000, ["not valid JSON"]),
])
def test_malformed_json_is_400(http, content, words):
    for path in (CHAT, COMPLETIONS):
        err = error_of(post(http, path, content=content), 400)
        assert all(w in err["message"] for w in words), err


# ---------------------------------------------------------------- fuzz

JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.text(max_size=20) | st.lists(TEXT_PART, max_size=2) | st.none()})
# Valid values, with edges: these bodies reach the worker and generate.
OPTIONAL = {
    "temperature": st.floats(0, 2) | st.sampled_from([0.0, 1e-30, 1e-6, 2.0]),
    "top_p": st.floats(1e-9, 1) | st.just(1.0),
    "top_k": st.integers(-1, 70000),
    "seed": st.integers(-(2 ** 63), 2 ** 64 - 1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logprobs": st.sampled_from([None, False]),
    "user": st.text(max_size=5),
}


REQUIRED = {"model", "messages", "prompt"}  # a missing one is named though the body lacks it


def valid_body(chat: bool):
    required = {"model": st.just(NAME), "max_tokens": st.integers(1, 4)}
    if chat:
        required["messages"] = st.lists(MESSAGE, min_size=1, max_size=3)
    else:
        required["prompt"] = st.text(max_size=30) | st.lists(st.integers(0, 49151), min_size=1, max_size=6)
    return st.fixed_dictionaries(required, optional=OPTIONAL)


def body_for(chat: bool):
    """Valid bodies, valid bodies with one field (or a new one) replaced by junk, and junk."""
    keys = sorted({"model", "max_tokens", "prompt", "messages", "junk", *OPTIONAL})
    broken = valid_body(chat).flatmap(
        lambda b: st.tuples(st.sampled_from(keys), JUNK).map(lambda kv: {**b, kv[0]: kv[1]}))
    return valid_body(chat) | broken | st.dictionaries(st.sampled_from(keys), JUNK) | JUNK


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.booleans().flatmap(lambda chat: st.tuples(st.just(chat), body_for(chat))))
def test_fuzzed_bodies_never_get_a_5xx(http, case):
    chat, body = case
    with http.stream("POST", CHAT if chat else COMPLETIONS, content=json.dumps(body),
                     headers={"Content-Type": "application/json"}) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, text
    if r.status_code != 200:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        if r.status_code == 400 and isinstance(body, dict):  # a body that is an object: the 400 names its field
            assert err["param"] and err["param"].split(".")[0].split("[")[0] in {*body, *REQUIRED}, (body, err)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text.split("\n"))
        assert events[-1] == "[DONE]"
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")


def _reencoded(body: dict):
    text = json.dumps(body, ensure_ascii=False)
    return st.sampled_from([text.encode("utf-16"), text.encode("utf-8-sig"), text.encode("latin-1", "replace"),
                            text.encode("utf-8").replace(b'"', b"'"), text.encode("utf-8")[: len(text) // 2]])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.booleans().flatmap(lambda chat: st.tuples(st.just(chat), st.one_of(
    st.binary(max_size=300),  # any bytes
    valid_body(chat).flatmap(_reencoded),  # a valid body in another encoding, or cut short
    st.text(max_size=50).map(lambda t: f'{{"model": "{NAME}", "prompt": "{t}", "max_tokens": 2}}'.encode(
        "utf-8", "surrogatepass")),  # raw text (quotes, backslashes, controls, surrogates) inside a string
))))
def test_fuzzed_bytes_never_get_a_5xx(http, case):
    chat, content = case
    r = post(http, CHAT if chat else COMPLETIONS, content=content)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
