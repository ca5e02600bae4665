"""The local concurrency benchmark (``bench --concurrency 1,2`` without ``--endpoint``): a closed
loop through continuous batching in this process, per spec policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdecode.bench.batched import measure_batched, same_outputs
from specdecode.core.drafter import random_drafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.loading import LoadedModel
from specdecode.runtime.decoders import Decoder
from specdecode.runtime.session import RuntimeConfig, Session
from tests.core.helpers import Tok
from tests.helpers import run_specdecode, tiny_model


@pytest.fixture(scope="module")
def session():
    model = tiny_model(seed=2, dtype=torch.float32)
    loaded = LoadedModel(model, Tok(), Path("tiny"), Path("tiny"))  # type: ignore[arg-type]
    return Session(RuntimeConfig(dtype="float32", weights="native"), loaded, torch.device("cpu"), torch.float32, 1)


def test_batched_runs_count_every_token_and_batch_the_requests(session):
    spec = SpecConfig(2, 1)
    decoder = Decoder(Eagle3Decoder(random_drafter(session.loaded.model, 60, seed=0), spec), "eagle3", "random", spec)
    prompts = [[5 + i, 9, 11 + i] for i in range(6)]
    one = measure_batched(session, decoder, prompts, 12, 1, "always")
    many = measure_batched(session, decoder, prompts, 12, 3, "always")
    plain = measure_batched(session, decoder, prompts, 12, 3, "never")
    # greedy: the same tokens whatever the batching, so the same counts
    assert one["completion_tokens"] == many["completion_tokens"] == plain["completion_tokens"] > 6
    assert one["batch_mean"] == 1.0 and many["batch_mean"] > 1.5
    assert many["spec_step_share"] == 1.0 and plain["spec_step_share"] == 0.0
    assert many["accept_length"] >= 1.0 and plain["accept_length"] is None
    assert many["ttft_ms_median"] > 0 and many["tpot_ms_median"] > 0
    # the time split: decode steps and prefill chunks are parts of the run, together at most all of it
    for run in (one, many, plain):
        assert run["step_ms_mean"] > 0 and 0 < run["decode_share"] < 1 and 0 < run["prefill_share"] < 1
        assert run["decode_share"] + run["prefill_share"] <= 1
    # float32: batching and the spec policy change no token (the check bench's "same output" column makes)
    assert same_outputs(one["outputs"], many["outputs"]) == same_outputs(one["outputs"], plain["outputs"]) == "6/6"
    assert [len(out) for out in one["outputs"]] == [12] * 6


def test_same_outputs_counts_identical_prompts_and_refuses_other_prompt_sets():
    assert same_outputs([[1, 2], [3]], [[1, 2], [4]]) == "1/2"
    assert same_outputs([], []) == "0/0"
    with pytest.raises(ValueError, match="different prompt sets"):
        same_outputs([[1]], [[1], [2]])


@pytest.mark.model
def test_bench_concurrency_cli_runs_in_process(tmp_path):
    out = tmp_path / "batched.json"
    proc = run_specdecode("bench", "--concurrency", "1,2", "--spec-policy", "never,always", "--num-prompts", "2",
                          "--max-new-tokens", "4", "--warmup", "0", "--dtype", "bfloat16", "--no-store",
                          "--out", str(out))
    assert "continuous batching" in proc.stdout
    run = json.loads(out.read_text())
    assert run["kind"] == "bench-batched"
    rows = [(r["policy"], r["concurrency"]) for r in run["summary"]]
    assert rows == [("never", 1), ("never", 2), ("always", 1), ("always", 2)]
    assert all(r["completion_tokens"] == 8 for r in run["summary"])
    assert run["summary"][0]["same_output"] == "2/2" and all("outputs" not in r for r in run["summary"])
    assert "same output" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "--concurrency values must be >= 1"),
    (["--concurrency", "two"], "--concurrency takes integers"),
    (["--concurrency", "1,2", "--endpoint", "http://127.0.0.1:9"], "one concurrency per run"),
    (["--concurrency", "2", "--spec-policy", "sometimes"], "--spec-policy takes always, never, auto"),
])
def test_bench_concurrency_flags_are_checked(flags, message):
    proc = run_specdecode("bench", *flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr
