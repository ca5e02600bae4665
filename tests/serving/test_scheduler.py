"""The scheduler (``serving/scheduler.py``) under load and through a request's lifecycle: client
disconnects free the slot, graceful shutdown finishes the running job and fails the queued ones,
concurrent requests batched (each as alone), a full queue refused with Retry-After, and many
concurrent streaming clients."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import signal
import threading
import time

import httpx
import pytest

from specdecode.core.batching import BatchConfig
from specdecode.core.engine import baseline_decode
from specdecode.core.requests import GenerateOptions
from specdecode.io.loading import LoadedModel
from specdecode.serving.app import create_app
from specdecode.serving.errors import APIError
from specdecode.serving.metrics import Metrics
from specdecode.serving.scheduler import Scheduler
from tests.serving.helpers import (
    CHAT,
    COMPLETIONS,
    CONTEXT,
    KEY,
    MSG,
    NAME,
    SPEC,
    STEP_S,
    Running,
    delta,
    expected,
    scrape,
    sse_events,
)


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
    # the left stream is counted as the client closing it, not by the 200 that began it
    route = '{route="/v1/completions",status="%s"}'
    assert delta(before, after, "specdecode_requests_total" + route % 499) == 1
    assert delta(before, after, "specdecode_requests_total" + route % 200) == 1  # the "Hi" alone
    assert after["specdecode_requests_running"] == 0 and after["specdecode_requests_queued"] == 0
    line = r"decode: #running-req \d, #queue-req \d, batch [\d.]+, spec steps 0%, gen throughput [\d.]+ tok/s"
    assert any(re.match(line, m) for m in caplog.messages), caplog.messages


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
            results["queued_stream"] = (r.status_code, r.headers, r.read())

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
    # draining: the port stays open while the running stream finishes (60 tokens x STEP_S = 2.4 s);
    # /health says so, and a new request is refused as the queued ones were
    health = http.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    late = http.post(CHAT, json={"model": NAME, "messages": MSG, "max_tokens": 5, "stream": True})
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert int(late.headers["retry-after"]) >= 1
    assert "running" not in results  # the drain above happened while it ran
    for t in threads:
        t.join(30)
    slow_server.thread.join(30)
    assert not slow_server.thread.is_alive()

    events = results["running"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    plain = results["queued_plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert int(plain.headers["retry-after"]) >= 1
    status, headers, body = results["queued_stream"]
    # a queued stream is answered before its status line: 503 and the error, as the README promises
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert int(headers["retry-after"]) >= 1


def test_a_drain_that_times_out_ends_each_stream_with_an_error_and_done(loaded, caplog):
    """Past --shutdown-timeout a running stream gets an in-band 503 and [DONE], not a cut
    connection, and the log no traceback per stream."""
    model = copy.deepcopy(loaded.model)
    model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    slowed = LoadedModel(model, loaded.tokenizer, loaded.source, loaded.model_dir)
    running = Running(create_app(slowed, baseline_decode, NAME, batch=BatchConfig(slots=2)), drain_s=0.5)
    results: dict[int, list] = {}

    def stream(i: int) -> None:  # 200 tokens x STEP_S = 8 s: far past the drain
        with httpx.stream("POST", running.url + CHAT, timeout=30, json={
                "model": NAME, "messages": MSG, "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            results[i] = sse_events(r.iter_lines())

    caplog.set_level(logging.WARNING)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    http = httpx.Client(base_url=running.url)
    deadline = time.monotonic() + 10
    while scrape(http)["specdecode_requests_running"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    running.server.handle_exit(signal.SIGTERM, None)
    for t in threads:
        t.join(30)
    running.thread.join(30)
    assert not running.thread.is_alive() and time.monotonic() - t0 < 5
    for events in results.values():
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert not any(e != "[DONE]" and e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
    assert len(results) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


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


def test_concurrent_requests_run_as_one_batch_and_each_equals_alone(server, http, loaded, decoder, tokenizer):
    """Requests in flight together share decode steps (batch size > 1 in /metrics) and each gets
    the greedy text it gets alone."""
    before = scrape(http)
    asks = [(f"Request number {i} asks:", 6 + 5 * i) for i in range(6)]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        prompt, max_tokens = asks[i]
        r = httpx.post(f"{server.url}{COMPLETIONS}", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (prompt, max_tokens) in enumerate(asks):
        assert results[i] == expected(loaded, decoder, tokenizer.encode(prompt), max_tokens).text, i
    after = scrape(http)
    steps = delta(before, after, "specdecode_batch_size_count")
    assert steps > 0 and delta(before, after, "specdecode_batch_size_sum") / steps > 1.5
    # 'adaptive' (the test server's policy) may decode a request without speculating: no accept length then
    assert delta(before, after, "specdecode_request_accept_length_count") <= \
        delta(before, after, 'specdecode_requests_total{route="/v1/completions",status="200"}') == len(asks)


def test_a_full_queue_answers_503_with_retry_after(loaded):
    """One slot, one queue place: the third request is refused at once with a Retry-After."""
    model = copy.deepcopy(loaded.model)
    model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    app = create_app(LoadedModel(model, loaded.tokenizer, loaded.source, loaded.model_dir), baseline_decode, NAME,
                     max_queued=1, batch=BatchConfig(slots=1))
    running = Running(app)
    base = running.url
    statuses: list[int] = []

    def long_request() -> None:
        statuses.append(httpx.post(base + COMPLETIONS, timeout=60, json={
            "model": NAME, "prompt": "Hi", "max_tokens": 30, "temperature": 0}).status_code)

    try:
        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first is running, the second queued
        http = httpx.Client(base_url=base)
        assert scrape(http)["specdecode_requests_queued"] == 1
        r = httpx.post(base + COMPLETIONS, json={"model": NAME, "prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1 and "retry in about" in r.json()["error"]["message"]
        for t in threads:
            t.join(60)
        assert statuses == [200, 200]  # the running and the queued one complete
    finally:
        running.stop()


def test_a_burst_is_admitted_up_to_slots_plus_queue():
    """Slots the worker has not filled yet take waiting requests too: with 2 slots and 4 queue places,
    a burst of 20 arriving before the worker moves any gets 6 in and 14 refused (it was 4 in)."""
    class Idle:  # a batcher the (unstarted) worker never touches
        active, free_slots = 0, 2

    scheduler = Scheduler(Idle(), Metrics(max_depth=0), max_queued=4)  # type: ignore[arg-type]

    async def burst():
        outcomes = []
        for _ in range(20):
            try:
                scheduler.submit([1, 2, 3], GenerateOptions(max_new_tokens=1))
                outcomes.append(200)
            except APIError as e:
                outcomes.append(e.status)
        return outcomes

    outcomes = asyncio.run(burst())
    assert outcomes == [200] * 6 + [503] * 14 and scheduler.load() == (0, 6)


def test_the_default_auto_policy_is_calibrated_before_the_first_request(loaded, decoder, caplog):
    """`serve`'s default spec policy times both modes per batch size on the worker thread before it
    serves, logs the choice, and the two identical greedy requests that follow give the same text."""
    caplog.set_level(logging.INFO, logger="specdecode")
    running = Running(create_app(loaded, decoder, NAME, batch=BatchConfig(slots=2)))
    try:
        body = {"model": NAME, "prompt": "Tell me a story", "max_tokens": 12, "temperature": 0}
        texts = [httpx.post(running.url + COMPLETIONS, json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(2)]
        batcher = running.app.state.server.scheduler.batcher
        assert set(batcher.policy.calibrated) == {1, 2} and texts[0] == texts[1]
        assert any("spec policy auto (" in r.getMessage() for r in caplog.records)
    finally:
        running.stop()


def test_compiled_steps_are_warmed_before_the_first_request_and_nothing_compiles_after(loaded, decoder, caplog):
    """With compiled steps installed, the server builds (or loads) every decode-step graph of its pool
    before it serves and seals the store: requests run on those graphs and wait for no compiler."""
    from dataclasses import replace

    from specdecode.core.compiled import CompiledRunner
    from tests.core.helpers import RecordingStore

    caplog.set_level(logging.INFO, logger="specdecode")
    store = RecordingStore()
    steps = CompiledRunner(store=store)
    body = {"model": NAME, "prompt": "Tell me a story", "max_tokens": 12, "temperature": 0}
    running = Running(create_app(loaded, replace(decoder, runner=steps), NAME,
                                 batch=BatchConfig(slots=2, spec_policy="always")))
    try:
        texts = [httpx.post(running.url + COMPLETIONS, json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(2)]
    finally:
        running.stop()
    warmed = set(store.built)
    assert warmed and {k.rows for k in warmed} == {1, 2}
    assert {k.span for k in warmed} == {0} and store.spans == {CONTEXT}  # stored graphs serve any span
    assert not steps.build and set(steps.graphs) == warmed and not steps.eager  # every step ran on a warmed graph
    assert any(f"{len(warmed)} graphs built, 0 loaded, 0 shapes eager" in r.getMessage() for r in caplog.records)
    assert texts[0] == texts[1] == expected(loaded, decoder, loaded.tokenizer.encode("Tell me a story"), 12).text


def test_health_says_starting_until_prepared_and_a_request_sent_meanwhile_waits(loaded):
    """/health is 503 "starting" while the worker prepares (compiled graphs, spec policy timing), so a
    load balancer sends nothing yet; a request sent anyway waits in the queue and is answered after."""
    app = create_app(loaded, baseline_decode, NAME, batch=BatchConfig(slots=1))
    scheduler = app.state.server.scheduler
    release = threading.Event()
    prepare = scheduler.prepare
    scheduler.prepare = lambda: (release.wait(30), prepare())
    running = Running(app, ready=False)
    statuses: list[int] = []
    try:
        health = httpx.get(running.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"].startswith("starting")
        body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        asking = threading.Thread(target=lambda: statuses.append(
            httpx.post(running.url + COMPLETIONS, timeout=60, json=body).status_code))
        asking.start()
        time.sleep(0.3)
        assert statuses == [] and scheduler.load() == (0, 1)  # queued, not refused
        release.set()
        asking.join(60)
        assert statuses == [200] and httpx.get(running.url + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        release.set()
        running.stop()
