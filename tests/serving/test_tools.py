"""The benchmark tools that drive a running server (benchmarks/tools/load_test.py, mixed_ttft.py), run against
the tiny test server: each must finish, lose no request and write what its docs describe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .helpers import KEY

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


def run_tool(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


def test_load_test(server, tmp_path):
    out = tmp_path / "load.json"
    run_tool("load_test.py", "--url", server.url, "--api-key", KEY, "--clients", "3", "--requests", "2",
             "--max-tokens", "6", "--out", str(out))
    summary = json.loads(out.read_text())
    assert summary["requests"] == 6 and summary["failures"] == 0 and summary["completion_tokens"] > 0
    assert summary["server_generated_tokens"] >= summary["completion_tokens"]


def test_mixed_ttft(server, tmp_path):
    out = tmp_path / "mixed.json"
    run_tool("mixed_ttft.py", "--url", server.url, "--api-key", KEY, "--long-words", "120", "--delay", "0.05",
             "--rounds", "1", "--out", str(out))
    (round_,) = json.loads(out.read_text())["rounds"]
    assert round_["short_ttft_s"] > 0 and round_["long_total_s"] > 0


def test_mixed_ttft_names_a_refused_key(server):
    proc = subprocess.run([sys.executable, str(TOOLS / "mixed_ttft.py"), "--url", server.url, "--api-key", "wrong",
                           "--rounds", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "401" in proc.stderr
