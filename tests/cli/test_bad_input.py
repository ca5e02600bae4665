"""Bad input across the CLI: exit code 2 and one line that says what is wrong, never a traceback, and
refused before the model loads (the loader fails the test if it is reached) with an empty cache left
empty."""

from __future__ import annotations

import pytest

from specdecode.cli.main import main
from specdecode.runtime import session

BAD = [
    (["generate", "Hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "Hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "Hi", "--top-k", "-3"], "top_k must be >= 0"),
    (["generate", "Hi", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["generate", "Hi", "--drafter", "/nonexistent"], "drafter directory not found"),
    (["generate", "Hi", "--no-spec", "--num-steps", "3"], "--no-spec decodes plain"),
    (["generate", "Hi", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["generate", "Hi", "--threads", "0"], "threads must be >= 1"),
    (["generate", "Hi", "--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (["serve", "--port", "99999"], "--port must be in [0, 65535]"),
    (["serve", "--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["serve", "--context-length", "32"], "--context-length must be >= 128 tokens, got 32"),
    (["compile", "--serve", "--context-length", "100"], "--context-length must be >= 128 tokens, got 100"),
    (["bench", "--methods", "baseline,eagle4", "--no-store"], "unknown method 'eagle4'"),
    (["bench", "--prompts", "/nonexistent.jsonl", "--no-store"], "/nonexistent.jsonl: no such file"),
    (["bench", "--num-prompts", "0", "--no-store"], "--num-prompts: must be at least 1"),
    (["bench", "--runs", "0", "--no-store"], "--runs: must be at least 1"),
    (["sweep", "--num-steps", "0", "--no-store"], "integers of at least 1"),
    (["sweep", "--topk", "x"], "expected comma-separated integers"),
    (["check", "--tolerance", "-1"], "--tolerance: must be 0 or more"),
    (["check", "--per-category", "0"], "--per-category: must be at least 1"),
    (["train", "--data", "/nonexistent", "--out", "OUT"], "build the data set with `specdecode data build`"),
    (["train", "--data", "DATA", "--out", "OUT", "--lr", "-1"], "lr=-1.0: it must be >= 0 (--lr)"),
    (["train", "--data", "DATA", "--out", "OUT", "--warmup-ratio", "2"], "warmup_ratio=2.0"),
    (["export", "--format", "vllm", "--out", "OUT", "--drafter", "/nonexistent"], "drafter directory not found"),
    (["data", "build", "--prompts", "/nonexistent.jsonl", "--out", "OUT"], "/nonexistent.jsonl"),
    (["eval-drafter", "--drafter", "/nonexistent", "--data", "/nonexistent"], "not found"),
    (["compile", "--compile-max-len", "1"], "--compile-max-len must be at least 2 tokens"),
    (["launch", "sglang", "--tp", "0", "--dry-run"], "--tp must be >= 1"),
    (["runs", "--limit", "0"], "--limit: must be at least 1"),
    (["formats", "--ks", "abc"], "--ks must be comma-separated integers"),
    (["train-report", "/nonexistent"], "training_summary.json: not found"),
    (["bogus"], "invalid choice: 'bogus'"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_before_the_model_loads(argv, words, tmp_path, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(session, "load_model", no_load)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "error: " in lines[0] and words in lines[0], err
    assert not cache.exists() or not any(cache.iterdir())


def test_serve_refuses_a_port_in_use_before_the_model_loads(monkeypatch, capsys):
    import socket

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(session, "load_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "choose --port" in err, err


def test_an_unwritable_cache_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A cache under a file, or read-only (a directory of mode 0555, or as root a read-only mount): one line that
    names the fix, before the model loads; it had first fallen back to other kernels, then ended in a traceback."""
    import os
    import subprocess

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the cache was checked")

    monkeypatch.setattr(session, "load_model", no_load)
    (tmp_path / "file").write_text("")
    caches = [tmp_path / "file" / "cache"]
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() != 0:
        ro.chmod(0o555)
        caches.append(ro)
    elif subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], capture_output=True).returncode == 0:
        mounted = True
        caches.append(ro)
    try:
        for cache in caches:
            monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
            assert main(["generate", "Hi", "--max-new-tokens", "2"]) == 2
            lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert len(lines) == 1 and f"the cache {cache} cannot be written" in lines[0], lines
            assert "set SPECDECODE_CACHE to a writable directory" in lines[0]
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        ro.chmod(0o755)
    assert len(caches) == 2 or os.geteuid() == 0  # the read-only case ran, unless root could not mount
