"""The app's routes (``serving/app.py``) on the real uvicorn server around a tiny random model with
the SmolLM2 tokenizer, driven by the official openai client and raw HTTP: health, models, auth,
completions and chat (plain and streamed), unknown routes and methods."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdecode.core.engine import baseline_decode
from specdecode.core.sampling import SamplingParams
from tests.serving.helpers import CHAT, COMPLETIONS, KEY, MSG, NAME, chat_ids, delta, error_of, expected, post, scrape


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



def test_a_repeated_system_prompt_comes_from_the_prefix_cache(http, client, loaded, decoder, tokenizer):
    """A second chat that starts like the first (the same long system prompt) reports the prompt tokens it
    found cached, in usage and /metrics, and answers as the engine does from scratch. Hits are whole prefill
    chunks (32 tokens in this server)."""
    system = {"role": "system", "content": "You answer in one short sentence. " * 8}
    before = scrape(http)
    for question, stream in (("Name a fruit.", False), ("Name a tree.", True)):
        messages = [system, {"role": "user", "content": question}]
        want = expected(loaded, decoder, tokenizer.encode_chat(messages), 12)
        if stream:
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
            text, usage = r.choices[0].message.content, r.usage
        assert text == want.text and usage.prompt_tokens == want.prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens  # the second request's
    assert cached >= 64 and cached % 32 == 0 and cached < usage.prompt_tokens
    assert delta(before, scrape(http), "specdecode_prefix_cache_hit_tokens_total") >= cached

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


def test_unknown_model_is_404(http, client):
    err = error_of(post(http, CHAT, {"model": "gpt-17", "messages": MSG}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "gpt-17" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    error_of(http.get("/v1/models/gpt-17"), 404)
    error_of(http.get("/no/such/route"), 404)


def test_unsupported_method_is_openai_shaped(http):
    err = error_of(http.get(COMPLETIONS), 405)
    assert err["type"] == "invalid_request_error"


def test_a_speculating_request_gets_its_own_speculative_metrics(loaded, decoder, tokenizer):
    """vLLM's per-request shape (``metrics.speculative_decoding``) in the response, and in a stream's last (usage)
    chunk: the request's own cycles, as the engine counts them decoding it alone; none where it never speculated."""
    from specdecode.core.batching import BatchConfig
    from specdecode.serving.app import create_app
    from tests.serving.helpers import Running

    messages = [{"role": "user", "content": "Count to five."}]
    want = expected(loaded, decoder, tokenizer.encode_chat(messages), 24).stats
    for policy in ("always", "never"):
        running = Running(create_app(loaded, decoder, NAME, api_key=KEY,
                                     batch=BatchConfig(spec_policy=policy, prefill_chunk=32)))
        try:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0)
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
        finally:
            running.stop()
        got, streamed = (r.model_extra or {}).get("metrics"), (chunks[-1].model_extra or {}).get("metrics")
        if policy == "never":
            assert got is None and streamed is None
            continue
        spec = got["speculative_decoding"]
        assert streamed == got
        assert spec["num_spec_steps"] == want["cycles"] and spec["mean_acceptance_length"] == pytest.approx(
            want["accept_length"])
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
        assert sum(j * n for j, n in enumerate(spec["acceptance_histogram"])) == spec["num_accepted_draft_tokens"]
        assert spec["num_draft_tokens"] == 2 * spec["num_spec_steps"] and spec["num_spec_tokens"] == 2  # SPEC: 2 steps
        assert spec["draft_acceptance_rate"] == pytest.approx(spec["num_accepted_draft_tokens"]
                                                              / spec["num_draft_tokens"])
