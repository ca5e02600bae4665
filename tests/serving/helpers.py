"""Shared helpers for the serving tests: the tiny test server's constants, a uvicorn server in a
background thread, and small readers of /metrics, SSE bodies and OpenAI-shaped errors."""

from __future__ import annotations

import json
import threading
import time

from specdecode.core.engine import Engine
from specdecode.core.requests import GenerateOptions
from specdecode.core.sampling import SamplingParams
from specdecode.core.speculative import SpecConfig
from specdecode.serving.app import make_server

NAME = "tiny-test"
KEY = "test-key"
CONTEXT = 256
SPEC = SpecConfig(2, 1)  # 3 draft-tree nodes: 3 cache slots reserved beyond the budget
STEP_S = 0.04  # per token in the slow server: long generations, far from the time limits below

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


class Running:
    """A uvicorn server in a background thread on a free loopback port."""

    def __init__(self, app, ready: bool = True, drain_s: float = 10) -> None:
        """``ready``: return once the worker has prepared (/health answers ok), not only once it listens;
        ``drain_s``: how long a shutdown waits for running requests."""
        self.app = app
        self.server = make_server(app, "127.0.0.1", 0, shutdown_timeout_s=drain_s, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while ready and not app.state.server.scheduler.ready:
            assert self.thread.is_alive() and time.monotonic() < deadline + 40, "the server did not get ready"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive()


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


def post(http, path, body=None, content=None, headers=None):
    if body is not None:
        content = json.dumps(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def wait_healthy(port: int, proc, log_path, timeout_s: float = 120) -> None:
    """Until a server process on ``port`` answers /health 200; fails (with its log) if it exits or takes longer."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
            return
        except httpx.HTTPError:
            assert time.time() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.5)
