"""`specdecode serve`: the real uvicorn server on a loopback port around a tiny random model
with the SmolLM2 tokenizer, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.core.drafter import random_drafter
from specdecode.core.engine import Engine, GenerateOptions, baseline_decode
from specdecode.core.profiler import SpecProfile
from specdecode.core.sampling import SamplingParams
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.loading import LoadedModel
from specdecode.serving.app import create_app, make_server
from tests.helpers import tiny_model

NAME = "tiny-test"
KEY = "test-key"
CONTEXT = 256
SPEC = SpecConfig(2, 1)  # 3 draft-tree nodes: 3 cache slots reserved beyond the budget
STEP_S = 0.04  # per token in the slow server: long generations, far from the time limits below


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tokenizer():
    from specdecode.io.loading import resolve_model_dir
    from specdecode.io.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir(None)[1])


@pytest.fixture(scope="module")
def loaded(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other core serves HTTP and runs the clients
    model = tiny_model(seed=0, dtype=torch.float32, vocab_size=len(tokenizer.hf),
                       max_position_embeddings=CONTEXT)
    yield LoadedModel(model, tokenizer, Path("tiny"), Path("tiny"))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def decoder(loaded):
    return Eagle3Decoder(random_drafter(loaded.model, draft_vocab_size=4096, seed=0), SPEC)


class Running:
    """A uvicorn server in a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.app = app
        self.server = make_server(app, "127.0.0.1", 0, shutdown_timeout_s=10, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server(loaded, decoder):
    running = Running(create_app(loaded, decoder, NAME, api_key=KEY, max_body_bytes=64 * 1024))
    yield running
    running.stop()


def slow(decoder, seconds):
    """A decoder that takes ``seconds`` per step: long generations for disconnect and shutdown."""
    def decode(*args):
        for step in decoder(*args):
            time.sleep(seconds)
            yield step
    return decode


@pytest.fixture
def slow_server(loaded):
    running = Running(create_app(loaded, slow(baseline_decode, STEP_S), NAME, log_interval_s=0.2))
    yield running
    if running.thread.is_alive():
        running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def expected(loaded, decoder, prompt_ids, max_tokens, stop=(), sampling=None):
    sampling = SamplingParams() if sampling is None else sampling
    engine = Engine(loaded.model, loaded.tokenizer, decoder)
    return engine.generate(prompt_ids, GenerateOptions(max_tokens, sampling, tuple(stop)))


def chat_ids(tokenizer, text):
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def scrape(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def sse_events(lines):
    """Parsed `data:` payloads of an SSE body; '[DONE]' stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


# ---------------------------------------------------------------- basics

def test_health_models_and_auth(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, server.url + path, headers=headers, json={"model": NAME, "prompt": "x"})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_chat_matches_engine(client, loaded, decoder, tokenizer):
    want = expected(loaded, decoder, chat_ids(tokenizer, "What is 2+2?"), 20)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.num_tokens)
    assert r.usage.total_tokens == want.prompt_tokens + want.num_tokens


def test_chat_stream_matches_engine(client, loaded, decoder, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    want = expected(loaded, decoder, tokenizer.encode_chat(messages), 24)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.num_tokens
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens


def test_completion_raw_text_matches_engine_and_baseline(client, loaded, decoder, tokenizer):
    prompt = "The capital of France is"
    want = expected(loaded, decoder, tokenizer.encode(prompt), 16)
    # speculative greedy decoding is lossless: the baseline gives the same tokens
    assert expected(loaded, baseline_decode, tokenizer.encode(prompt), 16).token_ids == want.token_ids
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == want.num_tokens
    streamed = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == want.finish_reason
    # token ids as the prompt, and OpenAI's default of 16 tokens
    r = client.completions.create(model=NAME, prompt=tokenizer.encode(prompt), temperature=0)
    assert r.choices[0].text == want.text


def test_stop_strings_and_seeded_sampling(client, loaded, decoder, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    full = expected(loaded, decoder, ids, 30).text
    stop = full[10:13]
    want = expected(loaded, decoder, ids, 30, stop=[stop])
    for stops in (stop, [stop, "\u2603never"]):
        r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=30, temperature=0, stop=stops)
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
        assert stop not in r.choices[0].text
    sampling = SamplingParams(0.9, 0, 0.95, 1234)
    want = expected(loaded, decoder, ids, 12, sampling=sampling)
    texts = [client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                       top_p=0.95, seed=1234).choices[0].text for _ in range(2)]
    assert texts == [want.text, want.text]


def test_spec_metrics_match_engine_profile(loaded, tokenizer):
    """/metrics adds up the same cycles the engine measures, here with a self-drafter
    (the target proposing its own tokens) so that accepted positions are non-zero."""
    ids = tokenizer.encode("Counting: one, two, three,")
    decoder = Eagle3Decoder(SelfDrafter(loaded.model, loaded.model, ids[0]), SpecConfig(3, 1))
    profile = SpecProfile()
    tokens = sum(len(c.token_ids) for c in Engine(loaded.model, loaded.tokenizer, decoder).stream(
        ids, GenerateOptions(40), profile))
    assert profile.accepted > 0
    running = Running(create_app(loaded, decoder, NAME))
    try:
        r = httpx.post(running.url + "/v1/completions",
                       json={"model": NAME, "prompt": ids, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens
        m = scrape(httpx.Client(base_url=running.url))
    finally:
        running.stop()
    assert m["specdecode_spec_cycles_total"] == profile.cycles
    assert m["specdecode_spec_draft_tokens_total"] == profile.drafted
    assert m["specdecode_spec_accepted_tokens_total"] == profile.accepted
    for i in (1, 2, 3):
        reached = sum(c for a, c in profile.depth_hist.items() if a >= i)
        assert m[f'specdecode_spec_accepted_per_position_total{{position="{i}"}}'] == reached
    assert m["specdecode_generation_tokens_total"] == tokens
    assert m['specdecode_requests_total{route="/v1/completions",status="200"}'] == 1
    phases = {p: m[f'specdecode_spec_phase_seconds_total{{phase="{p}"}}']
              for p in ("draft", "verify", "extend", "other")}
    assert all(v > 0 for v in phases.values())


# ---------------------------------------------------------------- validation

def post(http, path, body=None, content=None, headers=None):
    if body is not None:
        content = json.dumps(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


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
    (b"\xff\xfe", ["not valid JSON"]),
    (b"[1, 2]", ["JSON object"]),
    (b"[" * 5000 + b"]" * 5000, ["not valid JSON"]),
])
def test_malformed_json_is_400(http, content, words):
    for path in (CHAT, COMPLETIONS):
        err = error_of(post(http, path, content=content), 400)
        assert all(w in err["message"] for w in words), err


def test_unknown_model_is_404(http, client):
    err = error_of(post(http, CHAT, {"model": "gpt-17", "messages": MSG}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "gpt-17" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    error_of(http.get("/v1/models/gpt-17"), 404)
    error_of(http.get("/no/such/route"), 404)


def test_prompt_longer_than_context_names_the_numbers(http, tokenizer):
    prompt = "hello " * 400
    n = len(tokenizer.encode(prompt))
    err = error_of(post(http, COMPLETIONS, {"model": NAME, "prompt": prompt, "max_tokens": 8}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert f"{CONTEXT} tokens" in err["message"] and f"prompt has {n} tokens" in err["message"]
    chat_n = len(chat_ids(tokenizer, prompt))
    err = error_of(post(http, CHAT, {"model": NAME, "messages": [{"role": "user", "content": prompt}]}), 400)
    assert err["param"] == "messages" and f"prompt has {chat_n} tokens" in err["message"]
    # a prompt that fits, with a budget that does not: both numbers and the total
    ids = tokenizer.encode("hello " * 200)
    err = error_of(post(http, COMPLETIONS, {"model": NAME, "prompt": "hello " * 200, "max_tokens": 100}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    total = len(ids) + 100 + SPEC.num_draft_tokens
    assert f"but {total} were requested ({len(ids)} in the prompt, 100 for the completion" in err["message"]


def test_oversized_body_is_413(http):
    big = {"model": NAME, "prompt": "x" * (64 * 1024)}
    error_of(post(http, COMPLETIONS, big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]
    error_of(http.post(COMPLETIONS, content=chunked()), 413)
    assert http.get("/health").status_code == 200


def test_unsupported_method_is_openai_shaped(http):
    err = error_of(http.get(COMPLETIONS), 405)
    assert err["type"] == "invalid_request_error"


# ---------------------------------------------------------------- concurrency and lifecycle

def test_client_disconnect_mid_stream_frees_the_slot(slow_server, caplog):
    caplog.set_level(logging.INFO, logger="specdecode.serving.metrics")
    base = slow_server.url
    before = scrape(httpx.Client(base_url=base))
    budget = CONTEXT - 20
    body = {"model": NAME, "prompt": "Tell me a long story", "max_tokens": budget, "temperature": 0, "stream": True}
    with httpx.Client(base_url=base, timeout=30) as c, c.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(12)]  # some events, then hang up
        assert any(line.startswith("data: ") for line in seen)
    # a full generation takes budget * STEP_S = 9.4 s; the next request must not wait for it
    t0 = time.monotonic()
    r = httpx.post(base + COMPLETIONS, json={"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    assert time.monotonic() - t0 < 5.0
    after = scrape(httpx.Client(base_url=base))
    assert delta(before, after, "specdecode_generation_tokens_total") < budget / 2
    assert after["specdecode_requests_running"] == 0 and after["specdecode_requests_queued"] == 0
    assert any(re.match(r"decode: gen throughput [\d.]+ tok/s, running \d, queued \d", m)
               for m in caplog.messages), caplog.messages


def test_non_stream_disconnect_cancels_the_job(slow_server):
    base = slow_server.url
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s of 8 s
        httpx.post(base + COMPLETIONS, json={"model": NAME, "prompt": "Hi", "max_tokens": 200, "temperature": 0},
                   timeout=0.5)
    t0 = time.monotonic()
    r = httpx.post(base + COMPLETIONS, json={"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 4.0
    m = scrape(httpx.Client(base_url=base))
    assert m['specdecode_requests_total{route="/v1/completions",status="499"}'] == 1
    assert m["specdecode_generation_tokens_total"] < 100


def test_graceful_shutdown_finishes_running_and_fails_queued(slow_server):
    base = slow_server.url
    results: dict[str, object] = {}

    def running_stream():
        with httpx.stream("POST", base + CHAT, timeout=30, json={
                "model": NAME, "messages": MSG, "max_tokens": 60, "temperature": 0, "stream": True}) as r:
            results["running"] = sse_events(r.iter_lines())

    def queued_plain():
        results["queued_plain"] = httpx.post(base + COMPLETIONS, timeout=30, json={
            "model": NAME, "prompt": "Hi", "max_tokens": 5})

    def queued_stream():
        with httpx.stream("POST", base + COMPLETIONS, timeout=30, json={
                "model": NAME, "prompt": "Hi", "max_tokens": 5, "stream": True}) as r:
            results["queued_stream"] = (r.status_code, sse_events(r.iter_lines()))

    threads = [threading.Thread(target=running_stream)]
    threads[0].start()
    http = httpx.Client(base_url=base)
    deadline = time.monotonic() + 10
    while scrape(http)["specdecode_requests_running"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threads += [threading.Thread(target=queued_plain), threading.Thread(target=queued_stream)]
    for t in threads[1:]:
        t.start()
    while scrape(http)["specdecode_requests_queued"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    slow_server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn does on SIGTERM
    for t in threads:
        t.join(30)
    slow_server.thread.join(30)
    assert not slow_server.thread.is_alive()

    events = results["running"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    plain = results["queued_plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    status, events = results["queued_stream"]
    assert status == 200 and events[-1]["error"]["code"] == "shutting_down" and "[DONE]" not in events


def test_load_16_concurrent_streaming_clients(server, http, tokenizer):
    clients, per_client = 16, 4
    before = scrape(http)

    async def one(c: httpx.AsyncClient, i: int, k: int) -> dict:
        chat = (i + k) % 2 == 0
        body = {"model": NAME, "max_tokens": 4 + (i * 7 + k) % 9, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Client {i} request {k}"}]
        else:
            body["prompt"] = f"Client {i} request {k}:"
        async with c.stream("POST", CHAT if chat else COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]]
        assert finishes in (["stop"], ["length"]) and chunks[-1]["choices"][0]["finish_reason"]
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] <= body["max_tokens"]
        return {"chat": chat, **usage}

    async def client_loop(i: int) -> list[dict]:
        async with httpx.AsyncClient(base_url=http.base_url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as c:
            return [await one(c, i, k) for k in range(per_client)]

    async def main():
        return await asyncio.gather(*(client_loop(i) for i in range(clients)))

    results = [u for per in asyncio.run(main()) for u in per]
    assert len(results) == clients * per_client
    after = scrape(http)
    chats = sum(r["chat"] for r in results)
    assert delta(before, after, 'specdecode_requests_total{route="/v1/chat/completions",status="200"}') == chats
    assert delta(before, after, 'specdecode_requests_total{route="/v1/completions",status="200"}') == \
        len(results) - chats
    assert delta(before, after, "specdecode_generation_tokens_total") == sum(r["completion_tokens"] for r in results)
    assert delta(before, after, "specdecode_prompt_tokens_total") == sum(r["prompt_tokens"] for r in results)
    assert delta(before, after, "specdecode_time_to_first_token_seconds_count") == len(results)
    assert delta(before, after, "specdecode_spec_cycles_total") > 0
    assert delta(before, after, "specdecode_spec_draft_tokens_total") == \
        SPEC.max_depth * delta(before, after, "specdecode_spec_cycles_total")
    assert after["specdecode_requests_running"] == 0 and after["specdecode_requests_queued"] == 0


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
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text.split("\n"))
        assert events[-1] == "[DONE]"
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
