"""`eval-drafter --acceptance-table` over more than one data set: each set an equal share of the table."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdecode.core.costmodel import CANDIDATE_TOPK_STEPS
from specdecode.core.drafter import random_drafter
from specdecode.io.checkpoints import read_acceptance, save_drafter
from specdecode.io.loading import LoadedModel
from specdecode.io.paths import file_fingerprint
from specdecode.io.tokenizer import Tokenizer
from specdecode.runtime.session import RuntimeConfig, Session
from specdecode.training import evaluate
from specdecode.training.dataset import DataSet
from specdecode.training.evaluate import AcceptanceTableConfig, acceptance_table
from tests.helpers import tiny_model


class NoTokenizer:
    pass


def data_set(root, first_token, rows):
    ds = DataSet(root)
    ds.append([({"id": f"{first_token}{n:015x}", "split": "heldout", "source": "t", "mode": "greedy",
                 "loss_ranges": [[3, 8]]}, [first_token, 5, 6, 7, 8, 9, 10, 11]) for n in range(rows)])
    ds.write_manifest({"format": "specdecode-data-v1"})
    return str(root)


class FakeEngine:
    """Per-position acceptance by the prompt's first token: set A (1) accepts more, in fewer cycles."""

    def __init__(self, target, tokenizer, decoder):
        self.depth = decoder.spec.max_depth

    def generate(self, prompt, options):
        if prompt[0] == 1:
            pp, cycles = [0.8 / (i + 1) for i in range(self.depth)], 10
        else:
            pp, cycles = [0.4 / (i + 1) for i in range(self.depth)], 30
        return SimpleNamespace(stats={"cycles": cycles, "per_position_accept": pp})


def test_each_data_set_is_an_equal_share_of_the_table(tmp_path, monkeypatch):
    model = tiny_model()
    drafter_dir = tmp_path / "drafter"
    save_drafter(random_drafter(model, draft_vocab_size=50, seed=2), drafter_dir)
    session = Session(RuntimeConfig(dtype="float64"), LoadedModel(model, Tokenizer(NoTokenizer(), ()), Path("t"),
                                                                  Path("t")), torch.device("cpu"), torch.float64, 1)
    monkeypatch.setattr(evaluate, "Engine", FakeEngine)
    a, b = data_set(tmp_path / "a", 1, 4), data_set(tmp_path / "b", 2, 5)
    out = acceptance_table(AcceptanceTableConfig(data=(a, b), drafter=str(drafter_dir), samples=3), session)
    table = read_acceptance(drafter_dir)
    for topk, steps in CANDIDATE_TOPK_STEPS.items():
        depth = max(steps)
        # the mean of the two sets' figures (0.6 at position 1), not pooled by cycles (0.5: B's 3x cycles)
        assert table["per_position_accept"][topk] == pytest.approx([0.6 / (i + 1) for i in range(depth)], abs=1e-4)
        assert out["shapes"][str(topk)]["cycles"] == 3 * 10 + 3 * 30
    assert out["samples"] == 6 and out["data"] == [a, b]
    assert out["drafter_weights"] == file_fingerprint(drafter_dir / "model.safetensors")  # what auto checks
    assert [d["samples"] for d in out["by_data"]] == [3, 3]
    assert out["by_data"][1]["per_position_accept"]["1"][0] == pytest.approx(0.4)


def test_more_than_one_data_set_without_the_table_is_refused_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specdecode", "eval-drafter", "--data", "a", "b", "--drafter", "d"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "more than one --data is for --acceptance-table" in proc.stderr
