"""vLLM run for real, where it is installed in its own environment (scripts/setup_vllm.sh makes .venv-vllm;
$SPECDECODE_VLLM_PYTHON names another): `launch vllm` with its defaults answers as our float32 greedy decoding
does and accepts our drafter's drafts, and the `vllm` bench method measures it beside ours. Skipped without it
(CI has none); `scripts/test.sh -m vllm tests/integrations/test_vllm.py` runs them on purpose."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specdecode.bench.store import ResultsStore
from tests.helpers import run_specdecode

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("SPECDECODE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.vllm, pytest.mark.model,
              pytest.mark.skipif(not Path(PYTHON).is_file(), reason=f"no vLLM environment at {PYTHON} "
                                                                     "(scripts/setup_vllm.sh makes one)")]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_launch_vllm_answers_as_our_float32_greedy_and_accepts_our_drafts(tmp_path):
    port = free_port()
    log = tmp_path / "vllm.log"
    env = os.environ | {"SPECDECODE_RESULTS_DB": str(tmp_path / "r.db"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdecode", "launch", "vllm", "--engine-python", PYTHON,
                                 "--port", str(port), "--num-steps", "2"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        for prompt in PROMPTS:
            ours = run_specdecode("generate", prompt, "--dtype", "float32", "--weights", "native", "--no-spec",
                                  "--max-new-tokens", "24", "--json", "--compile", "off", timeout=300)
            expected = json.loads(ours.stdout.strip().splitlines()[-1])["text"]
            r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                "temperature": 0})
            assert r.json()["choices"][0]["message"]["content"] == expected.removesuffix("<|im_end|>")
        metrics = httpx.get(base + "/metrics", timeout=10).text
        accepted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
        assert accepted > 0, "vLLM accepted none of our drafter's tokens"
        (launch,) = ResultsStore(tmp_path / "r.db").runs_of_kind("launch")
        versions = launch.fingerprint["launch"]["engine_versions"]  # the engine's own environment, not ours
        assert versions["engine"].startswith("vllm") and versions["executable"] != sys.executable
        assert launch.fingerprint["dtype"] == "float32"
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_vllm_bench_method_beside_ours(tmp_path):
    out = tmp_path / "b.json"
    run_specdecode("bench", "--methods", f"baseline,eagle3:steps=2,topk=1,vllm:spec=eagle3,n=2,python={PYTHON}",
                   "--dtype", "float32", "--weights", "native", "--compile", "off", "--num-prompts", "2",
                   "--max-new-tokens", "24", "--no-store", "--out", str(out), timeout=900)
    summary = {row["method"]: row for row in json.loads(out.read_text())["summary"]}
    vllm = summary[f"vllm:spec=eagle3,n=2,python={PYTHON}"]
    assert vllm["outputs_match_baseline"] == "2/2" and vllm["accept_length"] > 1
    ours = summary["eagle3:steps=2,topk=1"]  # the same chain on the same prompts: vLLM accepts about as we do
    assert abs(vllm["accept_length"] - ours["accept_length"]) < 0.35, (vllm["accept_length"], ours["accept_length"])
