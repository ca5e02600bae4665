"""`specdecode serve` end to end: its flags (``cli/serve.py``), the served model's name, and
the real server under tensor parallelism in a fresh process (``serving/serve.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from specdecode.serving.serve import default_model_name
from tests.helpers import run_specdecode
from tests.serving.helpers import wait_healthy


def test_serve_cli_arguments():
    from specdecode.cli.main import build_parser, main
    from specdecode.cli.serve import run

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.func) == ("127.0.0.1", 8000, None, run)
    assert args.max_body_bytes == 1 << 20 and not args.no_spec
    args = build_parser().parse_args(["serve", "--port", "9001", "--api-key", "k", "--served-model-name", "m",
                                      "--drafter", "random", "--num-steps", "3"])
    assert (args.port, args.api_key, args.served_model_name, args.drafter, args.num_steps) == \
        (9001, "k", "m", "random", 3)
    assert main(["serve", "--port", "70000"]) == 2  # rejected before any model is loaded


def test_default_model_name():
    assert default_model_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "smollm2-135m-instruct"
    assert default_model_name(Path("/x/Qwen2.5-0.5B-Instruct")) == "qwen2.5-0.5b-instruct"
    assert default_model_name(Path("/x/llama-3-8b-Q4_K_M.gguf")) == "llama-3-8b"


@pytest.mark.model
def test_serve_tensor_parallel_matches_one_process_and_stops_cleanly(tmp_path):
    """`serve --tp 2`: rank 0 answers, rank 1 mirrors; greedy output equals `generate`; a stream
    dropped early stops both ranks (the next request still completes); SIGTERM ends all."""
    question = "What is the capital of France?"
    expected = json.loads(run_specdecode("generate", question, "--json", "--max-new-tokens", "24").stdout)["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", "--tp", "2", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        wait_healthy(port, proc, tmp_path / "serve.log")
        model = client.models.list().data[0].id
        ask = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24,
               "temperature": 0}
        assert client.chat.completions.create(**ask).choices[0].message.content == expected
        stream = client.chat.completions.create(**ask | {"max_tokens": 200, "stream": True})
        next(iter(stream))
        stream.close()  # rank 0 stops early: rank 1 must stop at the same step
        assert client.chat.completions.create(**ask).choices[0].message.content == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_builds_its_missing_graphs_and_the_next_start_runs_them(tmp_path):
    """A fresh cache: the first `serve` runs eager and, once ready, starts `specdecode compile --serve` with its
    own flags in the background; the second start with the same flags loads every graph (none eager, no build)
    and answers what the first did (float64: exactly), with no command in between."""
    from specdecode.runtime.background import running_build
    from tests.helpers import tiny_model_dir

    tiny_model_dir(tmp_path / "model")
    env = {"SPECDECODE_CACHE": str(tmp_path / "cache"), "SPECDECODE_BACKGROUND_COMPILE": "1"}
    flags = ["--model", str(tmp_path / "model"), "--dtype", "float64", "--kernels", "static", "--threads", "1",
             "--no-spec", "--max-running-requests", "2", "--context-length", "256"]
    ask = {"messages": [{"role": "user", "content": "t5 t9 t11 t40"}], "max_tokens": 16, "temperature": 0}

    def serve_once(name: str) -> tuple[str, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = tmp_path / f"{name}.log"
        with open(path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", *flags, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT, env=os.environ | env)
        try:
            wait_healthy(port, proc, path)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            text = client.chat.completions.create(model="model", **ask).choices[0].message.content
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        finally:
            if proc.poll() is None:
                proc.kill()
        return text or "", path.read_text()

    first, log = serve_once("first")
    assert "building the missing graphs in the background at the lowest priority" in log, log
    graphs = tmp_path / "cache" / "graphs"
    deadline = time.time() + 300
    while "graphs built" not in ((graphs / "build.log").read_text() if (graphs / "build.log").exists() else "") \
            or running_build(graphs) is not None:
        assert time.time() < deadline, (graphs / "build.log").read_text()
        time.sleep(1)
    second, log = serve_once("second")
    assert "graphs stored for these weights" in log and " loaded, 0 shapes eager" in log, log
    assert "building the missing graphs" not in log
    assert second == first
