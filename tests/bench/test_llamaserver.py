"""The llama-server bench method (``bench/llamaserver.py``) against a stand-in server: started on a free
port, the same token ids in, tokens and llama.cpp's draft counters out in our terms, stopped at the end;
a server that fails to start is an error with its log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdecode.bench.llamaserver import LlamaServerMethod, build_llamaserver

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def server(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def test_counters_in_our_terms():
    stats = LlamaServerMethod.stats(10, {"draft_n": 8, "draft_n_accepted": 6, "predicted_per_second": 50.0})
    assert (stats["cycles"], stats["accept_length"], stats["accept_rate"]) == (4, 2.5, 0.75)
    assert "cycles" not in LlamaServerMethod.stats(10, {})  # plain: no speculative counters


def test_plain_and_eagle3_methods_run_against_the_server(server, tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"")
    plain = build_llamaserver("llamaserver", {"server": str(server)}, gguf, 2, None, [2])
    try:
        out = plain.run([5, 9], 4)
        assert out.token_ids == [10, 11, 12, 13] and "cycles" not in out.stats and out.ttft_s <= out.elapsed_s
        assert plain.run([1, 7], 8).token_ids == [8, 9, 10, 2]  # stopped at eos: the stop token counted, as ours
        assert "-md" not in plain.command and plain.command[plain.command.index("-t") + 1] == "2"
    finally:
        plain.close()
    assert plain.server.proc.poll() is not None
    drafter = tmp_path / "d.gguf"
    drafter.write_bytes(b"")
    spec = build_llamaserver("llamaserver:spec=eagle3,n_max=3,ngram=ngram-simple+ngram-mod",
                             {"spec": "eagle3", "n_max": "3", "drafter": str(drafter), "server": str(server),
                              "ngram": "ngram-simple+ngram-mod"}, gguf, 2, None, [2])
    try:
        cmd = spec.command
        assert cmd[cmd.index("-md") + 1] == str(drafter) and cmd[cmd.index("--spec-draft-n-max") + 1] == "3"
        assert cmd[cmd.index("--spec-type") + 1] == "draft-eagle3,ngram-simple,ngram-mod"  # llama.cpp's hybrid
        out = spec.run([5], 6)
        assert out.stats["accepted"] == 3 and out.stats["accept_length"] == 2.0
    finally:
        spec.close()


def test_bad_parameters_and_a_failing_server_are_clear_errors(server, tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="unknown parameter"):
        build_llamaserver("llamaserver:topk=2", {"topk": "2"}, gguf, 2, None, [2])
    with pytest.raises(ValueError, match="unknown llama.cpp n-gram type.*ngram-simple"):
        build_llamaserver("llamaserver:ngram=suffix", {"ngram": "suffix"}, gguf, 2, None, [2])
    with pytest.raises(ValueError, match="n_max must be >= 1"):
        build_llamaserver("llamaserver:spec=eagle3,n_max=0", {"spec": "eagle3", "n_max": "0"}, gguf, 2, None, [2])
    with pytest.raises(ValueError, match="exited .* while starting:\n.*failed to load model"):
        LlamaServerMethod("llamaserver", gguf, 2, [2], server=str(server), extra=["--fail"])
    illegal = tmp_path / "llama-server-sigill"
    illegal.write_text("#!/bin/sh\nkill -ILL $$\n")
    illegal.chmod(0o755)
    with pytest.raises(ValueError, match="SIGILL: the build runs instructions .* CMAKE_ARGS"):
        LlamaServerMethod("llamaserver", gguf, 2, [2], server=str(illegal))


def test_llama_tools_are_found_beside_the_named_server(tmp_path, monkeypatch):
    from specdecode.io.llamacpp import LLAMA_SERVER_ENV, find_llama_server, find_llama_tool

    for name in ("llama-server", "llama-bench"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(tmp_path / "llama-server"))
    assert find_llama_server() == str(tmp_path / "llama-server")
    assert find_llama_tool("llama-bench") == str(tmp_path / "llama-bench")  # one build: its bench beside it
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no executable llama-server there.*specdecode\\[llamacpp\\]"):
        find_llama_server()
