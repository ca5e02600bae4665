"""scripts/train_default_drafter.sh end to end on CPU with a tiny budget: the plumbing its
--device cuda variant shares (data build, feature store or online target, training, held-out
evaluation by trainer and engine), and its refusals."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_default_drafter.sh"


def tiny_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    prompts = tmp_path / "prompts"
    (prompts / "long").mkdir(parents=True, exist_ok=True)
    topics = ["the sea", "bread", "a violin", "rain", "chess", "a bridge", "tea", "the moon"]
    rows = [{"prompt": f"Write one sentence about {t}.", "category": "writing"} for t in topics]
    rows += [{"prompt": f"What is {a} plus {a + 3}?", "category": "math"} for a in range(8)]
    (prompts / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return os.environ | {
        "PROMPTS": str(prompts), "DATA": str(tmp_path / "data"), "OUT": str(tmp_path / "drafter"),
        "FEATURES": str(tmp_path / "features"), "SAMPLE": "16", "MAX_NEW_TOKENS": "8", "BATCH_SIZE": "8",
        "HELDOUT_PERCENT": "30", "MAX_STEPS": "2", "EVAL_EVERY": "1000", "EVAL_SAMPLES": "4",
        "EVAL_ENGINE_SAMPLES": "2", "TABLE_SAMPLES": "1", "THREADS": "1", "COMPILE": "off",
        "CATEGORY_WEIGHTS": "writing=1,math=1"} | extra


def test_pipeline_runs_end_to_end_on_cpu_with_a_tiny_budget(tmp_path):
    proc = subprocess.run([str(SCRIPT), "--device", "cpu"], env=tiny_env(tmp_path), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["weights"] == "q4" and manifest["samples"] == 16
    assert json.loads((tmp_path / "features" / "meta.json").read_text())["batches_done"] >= 1
    summary = json.loads((tmp_path / "drafter" / "training_summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["draft_vocab_size"] == 8192
    assert summary["config"]["select"] == "best" and summary["config"]["patience"] == 3  # v4's recipe
    ev = json.loads((tmp_path / "drafter" / "eval-drafter.json").read_text())
    assert ev["samples"] == 2 and ev["engine_accept_length"] >= 1.0
    table = json.loads((tmp_path / "drafter" / "acceptance.json").read_text())  # what --spec-config auto reads
    assert [d["samples"] for d in table["measured"]["by_data"]] == [1, 1]
    assert table["measured"]["data"][1].endswith("smollm2-135m-unseen-v1")
    # run again: every step finds its work done; the data set, manifest included, is left as it was
    before = (tmp_path / "data" / "manifest.json").read_bytes()
    again = subprocess.run([str(SCRIPT), "--device", "cpu"], env=tiny_env(tmp_path), capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "data" / "manifest.json").read_bytes() == before
    assert "is complete for --sample 16; not built again" in again.stderr
    assert "resumed from" in again.stderr
    assert "acceptance table: " in again.stderr and "not measured again" in again.stderr, again.stderr[-2000:]


def test_pipeline_refuses_unknown_options_and_an_absent_gpu(tmp_path):
    proc = subprocess.run([str(SCRIPT), "--gpu"], env=tiny_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown option: --gpu" in proc.stderr
    proc = subprocess.run([str(SCRIPT), "--version", "v9"], env=tiny_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unknown version: v9" in proc.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([str(SCRIPT), "--device", "cuda"], env=tiny_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "torch sees no CUDA device" in proc.stderr
