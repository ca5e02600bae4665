"""Every script under benchmarks/tools/ runs here in a tiny form, so none rots unnoticed (issue 67:
`compiled_steps.py` had crashed for days). The two that need a running server run in tests/serving/test_tools.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "benchmarks" / "tools"
SERVER_TOOLS = {"load_test.py", "mixed_ttft.py"}  # run against the tiny test server: tests/serving/test_tools.py


def run_tool(name: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (name, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


def test_every_tool_has_a_smoke_run():
    """A new tool needs a run below (or in tests/serving/test_tools.py), or it goes to benchmarks/archive/."""
    here = Path(__file__).read_text() + (ROOT / "tests" / "serving" / "test_tools.py").read_text()
    untested = [t.name for t in TOOLS.glob("*.py") if f'run_tool("{t.name}"' not in here]
    assert not untested, untested
    assert {t.name for t in TOOLS.glob("*.py")} >= SERVER_TOOLS


def test_cycle_breakdown_reads_a_shipped_result(tmp_path):
    out = tmp_path / "breakdown.json"
    stdout = run_tool("cycle_breakdown.py", "benchmarks/results/2026-12-07-cycle/results.json",
                      "--step", "cycle.json", "--out", str(out))
    rows = json.loads(out.read_text())
    assert rows and stdout.startswith("method | draft")
    for row in rows.values():
        assert row["accept_length"] >= 1 and 0 < row["drafter_share"] < 1 and row["cycles"] > 0


def test_attention_kernels(tmp_path):
    out = tmp_path / "kernels.json"
    run_tool("attention_kernels.py", "--tokens", "1,2", "--keys", "16", "--rounds", "1", "--calls", "1",
             "--threads", "1", "--out", str(out))
    record = json.loads(out.read_text())
    assert "sdpa" in record["kernels"] and set(record["median_ms"]) == {"1", "2"}
    assert record["fingerprint"]["threads"] == 1


@pytest.mark.model
def test_compiled_steps_builds_and_times_a_graph(tmp_path):
    out = tmp_path / "steps.json"
    run_tool("compiled_steps.py", "--rows", "1", "--tokens", "1", "--eager", "--span", "256", "--rounds", "1",
             "--calls", "1", "--out", str(out))
    (step,) = json.loads(out.read_text())["steps"]
    assert step["rows"] == step["tokens"] == 1 and set(step["median_ms"]) == {"compiled", "eager"}


@pytest.mark.model
def test_reproducibility(tmp_path):
    stdout = run_tool("reproducibility.py", "--formats", "float32:native", "--limit", "1", "--max-new-tokens", "4",
                      "--repeats", "2", "--batch", "2", "--threads", "1", "--out", str(tmp_path))
    record = json.loads((tmp_path / "reproducibility.json").read_text())
    assert {r["mode"] for r in record["results"]} and "| float32 + native |" in stdout


@pytest.mark.model
def test_code_trees_runs_one_tree_against_itself(tmp_path):
    out = tmp_path / "trees.json"
    run_tool("code_trees.py", "--old", ".", "--new", ".", "--repeats", "1", "--config", "plain=--no-spec",
             "--max-new-tokens", "3", "--threads", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == "plain" and row["same_tokens"] and row["old_median"] > 0
