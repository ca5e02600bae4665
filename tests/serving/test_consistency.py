"""``check --endpoint`` (``bench.remote.consistency``): against the real server on the tiny model (float32, every
step speculative) a request gets its answer alone, again, not streamed and 4 at once, greedy and seeded; against
a server whose every answer differs, the check fails (exit 1) and names the way that differed."""

from __future__ import annotations

import itertools
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specdecode.bench.remote.consistency import ConsistencyConfig, check_endpoint
from specdecode.cli.main import main
from specdecode.core.batching import BatchConfig
from specdecode.io.prompts import Prompt
from specdecode.serving.app import create_app
from tests.serving.helpers import NAME, Running

PROMPTS = [Prompt(f"p{i}", "qa", ({"role": "user", "content": text},))
           for i, text in enumerate(("Name three rivers.", "What is a prime number?", "Say hello."))]


def test_the_real_server_answers_a_request_alike_however_it_is_sent(loaded, decoder):
    running = Running(create_app(loaded, decoder, NAME, batch=BatchConfig(slots=4, spec_policy="always")))
    try:
        report = check_endpoint(running.url, PROMPTS, ConsistencyConfig(copies=(4,), max_new_tokens=12))
        assert [c.mode for c in report.checks] == ["greedy", "seeded"] * len(PROMPTS)
        assert all(c.consistent for c in report.checks), [c for c in report.checks if not c.consistent]
        assert all(c.sent == {"not streamed": 1, "again": 1, "4 at once": 4} for c in report.checks)
        assert all(r["all"] == len(PROMPTS) for r in report.table())
        seeded = [c.reference for c in report.checks if c.mode == "seeded"]
        greedy = [c.reference for c in report.checks if c.mode == "greedy"]
        assert seeded != greedy  # the seeded requests sampled
    finally:
        running.stop()


def _differing_app() -> FastAPI:
    """Every answer another text: 'answer 1', 'answer 2', ..."""
    app = FastAPI()
    count = itertools.count(1)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = f"answer {next(count)}"
        if not body.get("stream"):
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "length"}]}

        async def events():
            for delta, finish in (({"content": text}, None), ({}, "length")):
                chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_server_that_answers_otherwise_fails_the_check(tmp_path, capsys):
    server = uvicorn.Server(uvicorn.Config(_differing_app(), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        out = tmp_path / "check.json"
        code = main(["check", "--endpoint", url, "--copies", "2", "--num-prompts", "1",
                     "--max-new-tokens", "4", "--out", str(out)])
        err = capsys.readouterr()
        assert code == 1 and "FAILED: 2 of 2 prompt checks" in err.err, err
        table = json.loads(out.read_text())["table"]
        assert table == [{"mode": m, "prompts": 1, "not streamed": 0, "again": 0, "2 at once": 0, "all": 0,
                          "errors": 0} for m in ("greedy", "seeded")]
        assert "not streamed: 0/1 equal" in err.err and "'answer 2'" in err.err
    finally:
        server.should_exit = True
        thread.join(10)
