"""The drafter training data kept in the repository (datasets/): readable, consistent with the
default model, no evaluation prompts."""

import json
from pathlib import Path

import numpy as np
import pytest

from specdecode.training.dataset import DataSet, heldout_split

ROOT = Path(__file__).resolve().parents[2] / "datasets"
SETS = sorted(p for p in ROOT.glob("*") if (p / "manifest.json").exists())


@pytest.mark.parametrize("path", SETS, ids=[p.name for p in SETS])
def test_shipped_data_set_is_consistent(path):
    ds = DataSet(path)
    rows = ds.index()
    tokens = ds.tokens()
    assert rows and len(tokens) == sum(r["length"] for r in rows)  # nothing torn, nothing dangling
    assert int(np.asarray(tokens).max()) < 49152 and int(np.asarray(tokens).min()) >= 0  # SmolLM2's vocabulary
    manifest = ds.manifest()
    # the corpus sets hold 5% out; the unseen-prompt set (acceptance tables) holds every answer out
    percent = 100.0 if "unseen" in path.name else 5.0
    assert manifest["heldout_percent"] == percent
    assert not any("spec_bench" in f or "FastChat" in f for f in manifest["prompt_files"])  # evaluation sets
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    for r in rows:
        (a, b), = r["loss_ranges"]
        assert 0 < a < b <= r["length"] and r["split"] == heldout_split(r["id"], percent)


@pytest.mark.model
@pytest.mark.parametrize("path", SETS, ids=[p.name for p in SETS])
def test_shipped_data_set_was_made_by_the_default_model(path):
    from specdecode.io.paths import default_model_path, file_fingerprint

    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["model_fingerprint"] == file_fingerprint(default_model_path())


@pytest.mark.parametrize("retired", sorted((ROOT / "retired").glob("*/prefix.json")), ids=lambda p: p.parent.name)
def test_a_retired_data_set_is_a_prefix_of_the_current_one(retired):
    """v3 and v4 left the tree: each is the first samples of v5, byte for byte (datasets/README.md says how to
    cut them back out)."""
    import hashlib

    rec = json.loads(retired.read_text())
    current = ROOT.parent / rec["prefix_of"]
    index = b"".join((current / "index.jsonl").read_bytes().splitlines(keepends=True)[:rec["samples"]])
    with open(current / "tokens.bin", "rb") as f:
        tokens = f.read(rec["token_bytes"])
    assert hashlib.sha256(index).hexdigest() == rec["sha256"]["index.jsonl"]
    assert hashlib.sha256(tokens).hexdigest() == rec["sha256"]["tokens.bin"]
