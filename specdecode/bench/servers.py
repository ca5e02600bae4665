"""Servers as bench methods: a server process bench starts and stops (``ServerProcess``: llama-server, vLLM),
and a running OpenAI-compatible server asked for each prompt's tokens (``ServedMethod``)."""

from __future__ import annotations

import atexit
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdecode.bench.output import RunOutput
from specdecode.bench.remote.metrics import read_spec_snapshot, spec_delta
from specdecode.bench.remote.request import RequestResult, stream_one
from specdecode.bench.remote.run import list_models, normalize_endpoint
from specdecode.io.paths import default_drafter_path


def check_server_params(spec: str, params: dict[str, str], keys: Sequence[str], engine: str, count: str,
                        what: str) -> int:
    """A started server's method parameters (``llamaserver``, ``vllm``): only ``keys``; ``spec`` none or eagle3
    (``engine``'s EAGLE-3); ``count`` (``what`` it counts) a positive integer, default 1. Returns the count."""
    unknown = set(params) - set(keys)
    if unknown:
        raise ValueError(f"method {spec!r}: unknown parameter(s) {sorted(unknown)}; use {', '.join(keys)}")
    if params.get("spec", "none") not in ("none", "eagle3"):
        raise ValueError(f"method {spec!r}: spec must be eagle3 ({engine}'s EAGLE-3) or none")
    try:
        n = int(params.get(count, "1"))
    except ValueError:
        raise ValueError(f"method {spec!r}: {count} ({what}) must be an integer") from None
    if n < 1:
        raise ValueError(f"method {spec!r}: {count} must be >= 1")
    return n


def eagle3_drafter(spec: str, params: dict[str, str], drafter_path: str | None) -> str | Path | None:
    """The drafter a started server's ``spec=eagle3`` method runs: ``drafter=``, else ``--drafter``, else the
    shipped one; None without ``spec=eagle3``."""
    if params.get("spec") != "eagle3":
        return None
    source = params.get("drafter") or drafter_path or default_drafter_path()
    if source is None:
        raise ValueError(f"method {spec!r} needs a drafter: drafter=PATH or --drafter")
    return source


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``command`` (which takes ``port``) run with its output in a log file, ready once ``GET ready_path``
    answers 200; stopped when bench ends. A process that exits or does not get ready in ``startup_s`` is a
    ValueError with the log's tail (and ``hint(returncode)``, where it has one)."""

    def __init__(self, name: str, what: str, command: Sequence[str], port: int, *, ready_path: str = "/health",
                 startup_s: float = 120.0, env: dict[str, str] | None = None,
                 hint: Callable[[int], str] = lambda code: "") -> None:
        import httpx

        self.name, self.what, self.port, self.command = name, what, port, list(command)
        self.base = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix=f"{what}-", suffix=".log")[1])
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env)
        atexit.register(self.close)
        deadline = time.monotonic() + startup_s
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ValueError(f"method {name!r}: {what} exited ({self.proc.returncode}) while starting:\n"
                                     f"{self.tail()}{hint(self.proc.returncode)}")
                try:
                    if client.get(self.base + ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.close()
        raise ValueError(f"method {name!r}: {what} did not answer {ready_path} within {startup_s:.0f} s:\n"
                         f"{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ServedMethod:
    """A server as one method of a local bench: each prompt's token ids go to its
    ``/v1/completions`` (streamed, greedy, ``return_token_ids``), timed on the client side and
    interleaved with the local methods, so ``served`` vs ``baseline`` is the serving overhead. Where the server
    has speculative counters (ours, vLLM's, llama-server's at ``/metrics``), a request's accept length is read
    from them around it."""

    def __init__(self, name: str, url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0, extra_body: dict | None = None) -> None:
        """``extra_body``: more fields for every request (e.g. vLLM's ``stop_token_ids``)."""
        import httpx

        self.name = name
        self.extra_body = dict(extra_body or {})
        self.counters = True  # its speculative counters (/metrics) around each request, while it has them
        self.base = normalize_endpoint(url)
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)))
        self.model = model or list_models(self.base, api_key, min(timeout_s, 30.0), self.client)[0]

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_new_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True} | self.extra_body
        res = RequestResult("", "")
        before = read_spec_snapshot(self.client, self.base, self.headers)[0] if self.counters else None
        stream_one(self.client, self.base + "/v1/completions", body, self.headers, "completions", self.timeout_s,
                    res, time.perf_counter())
        if not res.ok or res.ttft_s is None:
            raise RuntimeError(f"method {self.name}: the request to {self.base} failed: {res.error}")
        stats: dict = {"tokens_source": res.tokens_source}
        if self.counters:  # one request at a time: the counters' deltas are this request's
            after, _ = read_spec_snapshot(self.client, self.base, self.headers)
            delta = spec_delta(before, after) or {}
            if delta.get("cycles"):
                stats |= {"cycles": delta["cycles"], "accept_length": delta["accept_length"],
                          "accept_rate": delta["accept_rate"], "drafted": delta["draft_tokens"],
                          "accepted": delta["accepted_tokens"]}
            self.counters = after is not None  # a server without counters is not asked again
        return RunOutput(res.token_ids, res.latency_s, res.ttft_s, stats, num_tokens=res.completion_tokens)


