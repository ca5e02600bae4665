"""Request handling (``serving/handlers.py``): the context-length check, the body-size limit, and
clients that disconnect at any point."""

from __future__ import annotations

import json
import random
import socket
import time

from tests.serving.helpers import CHAT, COMPLETIONS, CONTEXT, KEY, NAME, SPEC, chat_ids, error_of, post, scrape


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


def _disconnect(url: str, path: str, body: bytes, cut: str, at: int) -> None:
    """One client that goes away: before its body ends (``cut='body'``, after ``at`` bytes of it), or
    after sending it whole and reading ``at`` bytes of the answer (``cut='answer'``)."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        if cut == "body":
            s.sendall(head + body[:at])
            return
        s.sendall(head + body)
        got = b""
        while len(got) < at and (part := s.recv(at - len(got))):
            got += part


def test_fuzzed_disconnects_leave_the_server_whole(server, http):
    """Clients that hang up at random points (mid-headers' body, while queued, mid-stream, before
    reading a whole answer) get no 5xx, leave no request running or queued, and the next request works."""
    rng = random.Random(0)
    before = scrape(http)
    for i in range(40):
        stream = rng.random() < 0.5
        chat = rng.random() < 0.5
        body = {"model": NAME, "max_tokens": rng.randint(1, 40), "temperature": 0, "stream": stream}
        body |= {"messages": [{"role": "user", "content": f"story {i}"}]} if chat else {"prompt": f"story {i}"}
        data = json.dumps(body).encode()
        cut = rng.choice(["body", "answer"])
        at = rng.randint(0, len(data) - 1) if cut == "body" else rng.choice([0, 1, 40, 200, 600])
        _disconnect(server.url, CHAT if chat else COMPLETIONS, data, cut, at)
    deadline = time.monotonic() + 30
    while (m := scrape(http))["specdecode_requests_running"] or m["specdecode_requests_queued"]:
        assert time.monotonic() < deadline, "requests were left running or queued after their clients left"
        time.sleep(0.05)
    after = scrape(http)
    fives = {k: v for k, v in after.items() if 'status="5' in k and v != before.get(k, 0.0)}
    assert not fives, fives
    r = post(http, COMPLETIONS, {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
