"""`specdecode train` on a tiny config: runs, writes the EAGLE-3 format, resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from specdecode.core.sampling import SamplingParams
from specdecode.io.checkpoints import load_drafter
from specdecode.io.hf import load_hf_dir
from specdecode.io.paths import OUTPUT_MARKER
from specdecode.training.dataset import DataSet, draft_vocab, heldout_split
from tests.helpers import eagle3_steps, plain_steps, save_tiny_hf


@pytest.fixture
def tiny_setup(tmp_path):
    model_dir = tmp_path / "model"
    save_tiny_hf(model_dir, num_hidden_layers=4)
    ds = DataSet(tmp_path / "data")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in range(48):
        prompt_len = 4 + n % 5
        length = prompt_len + 10 + n % 13
        ids = torch.randint(0, 101, (length,), generator=gen).tolist()
        pid = f"{n:016x}"
        rows.append(({"id": pid, "split": "heldout" if n % 8 == 0 else "train", "source": "test",
                      "mode": "greedy", "loss_ranges": [[prompt_len, length]]}, ids))
    ds.append(rows)
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"format": "specdecode-data-v1"}))
    return model_dir, tmp_path / "data", tmp_path


def train_cmd(model_dir, data, out, *extra):
    return [sys.executable, "-m", "specdecode", "train", "--model", str(model_dir), "--data", str(data),
            "--out", str(out), "--draft-vocab-size", "64", "--ttt-steps", "3", "--batch-tokens", "160",
            "--max-len", "64", "--eval-every", "5", "--eval-samples", "6", "--threads", "1", *extra]


def test_train_writes_eagle3_checkpoint_that_the_engine_loads(tiny_setup):
    model_dir, data, tmp = tiny_setup
    out = tmp / "drafter"
    proc = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "6", "--save-every", "3"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["final_eval"]["accept_length"] >= 1.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    target = load_hf_dir(model_dir, torch.float32, "cpu")
    drafter = load_drafter(out, target)
    assert int(drafter.t2d.sum()) == 64
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert len(log) == 6 and all(len(r["acc"]) == 3 for r in log)
    # stderr is a pipe, not a terminal: progress comes as lines (every 50 steps and at the last), no bar
    assert any(line.startswith("step 6/6: loss") and line.endswith("s/step") for line in proc.stderr.splitlines()), \
        proc.stderr  # one line, though longer than 80 columns
    assert "training ━" not in proc.stderr and "━" not in proc.stderr, proc.stderr


def test_the_step_log_grows_while_training_and_best_needs_held_out_samples(tiny_setup):
    """training_log.jsonl had been written only at the end; with no held-out samples --select best
    silently took the last step."""
    model_dir, data, tmp = tiny_setup
    out = tmp / "drafter"
    proc = subprocess.Popen(train_cmd(model_dir, data, out, "--max-steps", "400", "--save-every", "1000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = out / "training_log.jsonl", time.time() + 300
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert time.time() < deadline and proc.poll() is None, "no step log while training"
            time.sleep(0.05)
        assert not (out / "training_summary.json").exists()  # still running
    finally:
        proc.kill()
        proc.wait()
    assert all(json.loads(line)["loss"] > 0 for line in log.read_text().splitlines()[:3])

    no_heldout = DataSet(tmp / "train-only")
    src = DataSet(data)
    no_heldout.append([(row | {"split": "train"}, src.read(row)[0]) for row in src.samples()])
    (tmp / "train-only" / "manifest.json").write_text(json.dumps({"format": "specdecode-data-v1"}))
    refused = subprocess.run(train_cmd(model_dir, tmp / "train-only", tmp / "d2", "--max-steps", "2"),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "no held-out samples" in refused.stderr and "--select last" in refused.stderr
    assert "Traceback" not in refused.stderr
    last = subprocess.run(train_cmd(model_dir, tmp / "train-only", tmp / "d2", "--max-steps", "2", "--select", "last"),
                          capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr


def test_kill_and_resume_gives_the_same_result(tiny_setup):
    """Feature noise on: its draws are seeded per step, so a resumed run draws the same noise."""
    model_dir, data, tmp = tiny_setup
    steps = "30"
    ref = subprocess.run(train_cmd(model_dir, data, tmp / "ref", "--max-steps", steps, "--save-every", "1",
                                   "--feature-noise", "0.05"),
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr

    out = tmp / "killed"
    proc = subprocess.Popen(train_cmd(model_dir, data, out, "--max-steps", steps, "--save-every", "1",
                                      "--feature-noise", "0.05"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / "checkpoint" / "trainer_state.json"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if json.loads(state.read_text())["step"] >= 8:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(state.read_text())["step"]
    assert 8 <= killed_at < int(steps), "the run finished before it could be killed"
    resumed = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", steps, "--save-every", "1",
                                       "--feature-noise", "0.05"),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    a = load_file(str(tmp / "ref" / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_feature_noise_is_relative_to_each_tap_and_seeded():
    from specdecode.training.trainer import add_feature_noise

    gen = torch.Generator().manual_seed(1)
    # two taps of very different scale (SmolLM2's first-token activations are ~1e4)
    hidden = torch.cat((torch.randn(2, 50, 64, generator=gen) * 1e4, torch.randn(2, 50, 64, generator=gen)), -1)
    noisy = add_feature_noise(hidden, 2, 0.1, seed=7)
    for tap in (slice(0, 64), slice(64, 128)):
        rel = (noisy[..., tap] - hidden[..., tap]).pow(2).mean().sqrt() / hidden[..., tap].pow(2).mean().sqrt()
        assert 0.09 < float(rel) < 0.11
    assert torch.equal(noisy, add_feature_noise(hidden, 2, 0.1, seed=7))
    assert not torch.equal(noisy, add_feature_noise(hidden, 2, 0.1, seed=8))


def test_train_on_an_absent_cuda_device_is_a_clear_error(tiny_setup):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    model_dir, data, tmp = tiny_setup
    proc = subprocess.run(train_cmd(model_dir, data, tmp / "d", "--max-steps", "1", "--device", "cuda"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stderr


def test_mismatched_checkpoint_is_a_clear_error(tiny_setup):
    model_dir, data, tmp = tiny_setup
    out = tmp / "d"
    assert subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "2", "--save-every", "1"),
                          capture_output=True, text=True, timeout=300).returncode == 0
    proc = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "4").__add__(["--seed", "5"]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "checkpoint was made with seed=0" in proc.stderr
    (out / "checkpoint" / "trainer_state.json").write_text("{broken")
    proc = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "4"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "corrupt checkpoint" in proc.stderr


def test_draft_vocab_is_top_frequency_with_offsets():
    import numpy as np

    counts = np.array([5, 0, 9, 1, 7, 0])
    d2t, t2d, coverage = draft_vocab(counts, 3)
    assert t2d.tolist() == [True, False, True, False, True, False]
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]
    assert coverage == pytest.approx(21 / 22)


def test_heldout_split_is_stable():
    assert heldout_split("ffffffff00000000", 5.0) == heldout_split("ffffffff00000000", 5.0)
    share = sum(heldout_split(f"{i * 2654435761 % 2**32:08x}", 10.0) == "heldout" for i in range(2000)) / 2000
    assert 0.07 < share < 0.13


def test_trainer_acceptance_agrees_with_engine(tmp_path):
    """Held-out acceptance simulated by the trainer equals what the engine measures on the
    same greedy samples (float64, tiny model): any gap would be a wiring or mask bug."""
    from specdecode.core.speculative import SpecConfig
    from specdecode.training.trainer import TrainConfig, train
    from specdecode.training.ttt import (
        collate,
        needed_positions,
        simulated_accept_length,
        step_result,
        target_batch,
        ttt_forward,
    )

    model_dir = tmp_path / "model"
    save_tiny_hf(model_dir, num_hidden_layers=4, vocab_size=101)
    target = load_hf_dir(model_dir, torch.float64, "cpu")
    gen = torch.Generator().manual_seed(0)
    ds = DataSet(tmp_path / "data")
    rows = []
    for n in range(60):
        prompt = torch.randint(0, 101, (3 + n % 4,), generator=gen).tolist()
        out = [t for s in plain_steps(target, prompt, 24, SamplingParams())
               for t in s.tokens]
        rows.append(({"id": f"{n:016x}", "split": "heldout" if n % 6 == 0 else "train", "source": "t",
                      "mode": "greedy", "loss_ranges": [[len(prompt), len(prompt) + len(out)]]}, prompt + out))
    ds.append(rows)
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "d"), model=str(model_dir), draft_vocab_size=80,
                      ttt_steps=3, batch_tokens=256, max_len=64, max_steps=40, lr=3e-3, eval_every=1000,
                      save_every=1000, target_dtype="float64", autocast=False)
    train(cfg)
    from specdecode.io.checkpoints import load_drafter

    drafter = load_drafter(tmp_path / "d", target, dtype=torch.float64)
    t2d = drafter.t2d
    t2d_index = torch.full((101,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(int(t2d.sum()))
    held = ds.samples("heldout")
    sim_t = sim_c = eng_t = eng_c = 0
    for r in held:
        tokens, valid, loss_mask = collate(ds, [r], [0], 64, None)
        with torch.no_grad():
            tb = target_batch(target, tokens, needed_positions(valid, loss_mask), drafter.config.aux_layer_ids, t2d,
                              t2d_index)
            outs = ttt_forward(drafter, tokens, valid, tb, 3)
            correct = [step_result(drafter, h, tb, valid, loss_mask, j).correct for j, h in enumerate(outs)]
        t, c = simulated_accept_length(correct, valid, loss_mask, 3)
        sim_t, sim_c = sim_t + t, sim_c + c
        start, end = r["loss_ranges"][0]
        steps = list(eagle3_steps(
            target, drafter, tokens[0, :start].tolist(), end - start,
            SamplingParams(), None, SpecConfig(3, 1)))
        assert [t for s in steps for t in s.tokens][:end - start] == tokens[0, start:end].tolist()
        cycles = [s.cycle for s in steps if s.cycle]
        # the engine may run one cycle past the stored response; compare the cycles inside it
        inside, produced = [], 1
        for cyc in cycles:
            if produced + cyc.accepted + 1 > end - start:
                break
            inside.append(cyc)
            produced += cyc.accepted + 1
        eng_t += sum(cy.accepted + 1 for cy in inside)
        eng_c += len(inside)
    print("trainer", sim_t / sim_c, "engine", eng_t / eng_c)
    assert sim_t / sim_c > 1.2, "the drafter learned too little for the comparison to mean anything"
    assert (sim_t, sim_c) == (eng_t, eng_c)  # same cycles, same accepted counts


def test_train_report_table_and_plot(tmp_path):
    from specdecode.training.report import collect, markdown, plot

    for n, acc in ((100, 1.5), (400, 2.1)):
        d = tmp_path / f"r{n}"
        d.mkdir()
        (d / "training_summary.json").write_text(json.dumps({
            "samples": n, "assistant_tokens": n * 50, "steps": n // 10, "coverage": 0.97, "seconds_this_run": 60,
            "final_eval": {"accept_length_by_depth": {"2": acc, "3": acc + 0.2}, "step_acc": [0.6, 0.5]}}))
    rows = collect([str(tmp_path / "r400"), str(tmp_path / "r100")])
    assert [r["samples"] for r in rows] == [100, 400]
    text = markdown(rows)
    assert "| 100 | 5000 | 10 | 97.0% | - | - | 1.50 | 1.70 | - | - | 0.60 | 1.0 |" in text
    # runs that differ in a setting name it
    for n, lr in ((100, 1e-3), (400, 3e-4)):
        summary = json.loads((tmp_path / f"r{n}" / "training_summary.json").read_text())
        (tmp_path / f"r{n}" / "training_summary.json").write_text(json.dumps(summary | {
            "config": {"lr": lr, "ttt_steps": 3, "out": f"r{n}"}}))
    text = markdown(collect([str(tmp_path / "r400"), str(tmp_path / "r100")]))
    assert text.splitlines()[0].startswith("| settings | samples")
    assert "| lr=0.0003 | 400 |" in text and "ttt_steps" not in text
    plot(rows, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_cached_features_give_the_online_target_batch(tiny_setup, monkeypatch):
    from specdecode.training.features import build_features, cached_target_batch
    from specdecode.training.ttt import collate, needed_positions, target_batch

    model_dir, data, tmp = tiny_setup
    target = load_hf_dir(model_dir, torch.float64, "cpu")
    ds = DataSet(data)
    rows = ds.samples("train")
    aux = target.config.eagle3_aux_layer_ids
    d2t, t2d, _ = draft_vocab(torch.bincount(torch.randint(0, 101, (500,), generator=torch.Generator().manual_seed(0)),
                                             minlength=101).numpy(), 64)
    t2d_index = torch.full((101,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(64)

    class Killed(Exception):
        pass

    monkeypatch.setattr("specdecode.training.features.BUILD_BATCH_TOKENS", 100)  # several batches

    def kill_after_two(p):
        if p.done == 2:
            raise Killed

    with pytest.raises(Killed):  # a build killed after two batches resumes where it stopped
        build_features(tmp / "f", ds, target, aux, 64, "tiny", on_progress=kill_after_two)
    store = build_features(tmp / "f", ds, target, aux, 64, "tiny")
    fresh = build_features(tmp / "g", ds, target, aux, 64, "tiny")
    for a, b in zip(store.arrays(), fresh.arrays(), strict=True):
        assert (a == b).all()
    arrays = store.arrays()
    head = target.lm_head.weight.detach()[t2d]
    for idx in ([0, 1, 2], [5, 17, 30, 3]):
        tokens, valid, loss = collate(ds, rows, idx, 64, None)
        needed = needed_positions(valid, loss)
        online = target_batch(target, tokens, needed, aux, t2d, t2d_index)
        cached = cached_target_batch(store, arrays, rows, idx, needed, head, t2d, t2d_index)
        torch.testing.assert_close(cached.hidden[valid], online.hidden[valid], rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(cached.probs.float(), online.probs.float(), rtol=0, atol=1e-2)  # stored in bf16
        assert torch.equal(cached.row, online.row) and torch.equal(cached.best, online.best)
    with pytest.raises(ValueError, match="made for other data or another target"):
        build_features(tmp / "f", ds, target, aux, 32, "tiny")


def test_training_from_cached_features_matches_online_training(tiny_setup):
    model_dir, data, tmp = tiny_setup
    args = ("--max-steps", "6", "--dtype", "float32", "--no-autocast")
    online = subprocess.run(train_cmd(model_dir, data, tmp / "online", *args), capture_output=True, text=True,
                            timeout=300)
    cached = subprocess.run(train_cmd(model_dir, data, tmp / "cached", *args, "--feature-cache", str(tmp / "feat")),
                            capture_output=True, text=True, timeout=300)
    assert online.returncode == 0 and cached.returncode == 0, cached.stderr
    assert "target features: 1/" in cached.stderr
    a = load_file(str(tmp / "online" / "model.safetensors"))
    b = load_file(str(tmp / "cached" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=0, atol=1e-2)


def test_train_report_measures_the_draft_vocab_share_of_heldout_tokens(tmp_path):
    from safetensors.torch import save_file

    from specdecode.training.report import heldout_coverage

    ds = DataSet(tmp_path / "data")
    ds.append([({"id": "a", "split": "heldout", "loss_ranges": [[1, 5]]}, [9, 1, 2, 3, 7]),
               ({"id": "b", "split": "train", "loss_ranges": [[0, 2]]}, [8, 8])])
    run = tmp_path / "run"
    run.mkdir()
    # draft vocabulary {1, 3, 8}: d2t holds target id - draft id
    save_file({"d2t": torch.tensor([1, 2, 6])}, str(run / "model.safetensors"))
    assert heldout_coverage(run, str(tmp_path / "data")) == 2 / 4  # held-out answer 1 2 3 7: 1 and 3 inside
    assert heldout_coverage(run, None) is None


def test_best_and_patience_follow_the_heldout_curve():
    """``_track_best``: the best evaluation is kept (any gain), ``patience`` counts evaluations
    without a gain of ``min_delta``, and the run stops at the count."""
    from specdecode.training.trainer import TrainConfig, _track_best

    cfg = TrainConfig(data="d", out="o", patience=3, min_delta=0.01)
    state = {"step": 0, "epoch": 0}
    saved, stale = [], []
    for step, al in enumerate([1.20, 1.30, 1.305, 1.29, 1.31], start=1):
        state["step"] = step
        _track_best(state, al, cfg, lambda: saved.append(state["step"]))
        stale.append(state["stale"])
        assert ("stopped_early" in state) == (step == 5)
    assert saved == [1, 2, 3, 5] and stale == [0, 0, 1, 2, 3]
    assert state["best"] == {"step": 5, "epoch": 0, "accept_length": 1.31} and state["stopped_early"] == 5
    with pytest.raises(ValueError, match="select"):
        TrainConfig(data="d", out="o", select="final")


def test_train_stops_on_a_flat_curve_and_writes_the_best(tiny_setup):
    model_dir, data, tmp = tiny_setup
    out = tmp / "drafter"
    cmd = train_cmd(model_dir, data, out, "--max-steps", "30", "--save-every", "5", "--patience", "1",
                    "--min-delta", "10")  # no evaluation gains 10: stop at the second one
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 10 and summary["stopped_early"] and "stopping" in proc.stderr
    evals = json.loads((out / "checkpoint" / "trainer_state.json").read_text())["evals"]
    best = max(evals, key=lambda e: e["accept_length"])
    assert summary["best"]["step"] == best["step"] == summary["selected_step"]
    written = load_file(str(out / "model.safetensors"))
    kept = load_file(str(out / "best" / "model.safetensors"))
    assert all(torch.equal(written[k], kept[k]) for k in written)
    assert json.loads((out / "config.json").read_text())["specdecode_training"]["steps"] == best["step"]
    # run again: the stop is part of the checkpoint, nothing more is trained
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["steps"] == 10


def test_init_from_a_trained_drafter_continues_from_its_weights(tiny_setup):
    model_dir, data, tmp = tiny_setup
    first = tmp / "first"
    proc = subprocess.run(train_cmd(model_dir, data, first, "--max-steps", "4"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    # learning rate 0: the continued run must write exactly the weights it started from
    cont = tmp / "continued"
    proc = subprocess.run(train_cmd(model_dir, data, cont, "--max-steps", "2", "--lr", "0", "--select", "last",
                                    "--init-from", str(first)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    a, b = load_file(str(first / "model.safetensors")), load_file(str(cont / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the starting drafter is evaluated before the first step: the curve starts from it, and with
    # nothing learnt it stays the best (the one --select best would write)
    state = json.loads((cont / "checkpoint" / "trainer_state.json").read_text())
    assert state["evals"][0]["step"] == 0 and state["best"]["step"] == 0
    assert "step 0: held-out accept length" in proc.stderr
    proc = subprocess.run(train_cmd(model_dir, data, tmp / "other", "--max-steps", "2", "--init-from", str(first),
                                    "--draft-vocab-size", "32"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "pass --draft-vocab-size 64" in proc.stderr


def test_a_variant_continues_a_trained_drafter_and_is_written_for_vllm(tiny_setup):
    """--variant fc_norm,norm_output (EAGLE-3.1) from a plain drafter: its weights carried over, the new
    per-tap norms set to the taps' median RMS, and the result written in the speculators layout that loads
    back as that variant."""
    model_dir, data, tmp = tiny_setup
    first = tmp / "first"
    assert subprocess.run(train_cmd(model_dir, data, first, "--max-steps", "2"), timeout=300).returncode == 0
    out = tmp / "v31"
    proc = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "2", "--lr", "0", "--select", "last",
                                    "--init-from", str(first), "--variant", "fc_norm,norm_output"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["fc_norm"] and cfg["norm_output"]
    a, b = load_file(str(first / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k.replace("midlayer.", "layers.0.")]) for k in a)  # lr 0: carried over
    scales = [b[f"fc_norm.{i}.weight"] for i in range(3)]
    assert all(bool((s == s[0]).all()) and float(s[0]) > 0 for s in scales)
    assert len({float(s[0]) for s in scales}) > 1  # each tap its own scale (two of the tiny taps are one layer)
    target = load_hf_dir(model_dir, torch.float64, "cpu")
    assert load_drafter(out, target).config.variant == ("fc_norm", "norm_output")
    bad = subprocess.run(train_cmd(model_dir, data, tmp / "bad", "--max-steps", "1", "--variant", "fc_nrom"),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "use flags among fc_norm" in bad.stderr


@pytest.mark.parametrize("fast", [True, False])
def test_training_precision_follows_the_device(monkeypatch, fast):
    """bf16 (target and autocast) only where the device computes it natively: emulated on an
    AVX2-only CPU it made a training step 10x slower than fp32."""
    import specdecode.training.trainer as trainer

    monkeypatch.setattr(trainer, "fast_bf16", lambda device: (fast, "the CPU says so"))
    cfg, why = trainer.resolve_precision(trainer.TrainConfig(data="d", out="o"), torch.device("cpu"))
    assert (cfg.target_dtype, cfg.autocast) == (("bfloat16", True) if fast else ("float32", False))
    assert "the CPU says so" in why
    asked = trainer.TrainConfig(data="d", out="o", target_dtype="float32", autocast=True)
    cfg, why = trainer.resolve_precision(asked, torch.device("cpu"))
    assert (cfg.target_dtype, cfg.autocast) == ("float32", True) and why == "target float32, draft bf16 autocast"
    with pytest.raises(ValueError, match="unknown dtype"):
        trainer.resolve_precision(trainer.TrainConfig(data="d", out="o", target_dtype="fp8"), torch.device("cpu"))


def test_samples_with_no_answer_inside_max_len_are_skipped_not_trained_as_empty_steps(tiny_setup):
    """Long prompts whose answers start past --max-len used to be batched together (by length) into steps
    with no loss at all (3% of drafter v4's steps); they are now left out, and the run says how many."""
    from specdecode.training.dataset import trains_inside

    assert trains_inside({"loss_ranges": [[2, 3]], "length": 3}, 64)
    assert not trains_inside({"loss_ranges": [[1, 2]], "length": 3}, 64)
    assert not trains_inside({"loss_ranges": [[64, 80]], "length": 80}, 64)
    assert trains_inside({"loss_ranges": [[63, 80]], "length": 80}, 64)  # index 63 is the last inside the cut
    assert trains_inside({"loss_ranges": [[70, 80], [5, 9]], "length": 80}, 64)
    model_dir, data, tmp = tiny_setup
    ds = DataSet(data)
    gen = torch.Generator().manual_seed(1)
    ds.append([({"id": f"{n:08x}ffffffff", "split": "train", "source": "test", "mode": "greedy",
                 "loss_ranges": [[70, 90]]}, torch.randint(0, 101, (90,), generator=gen).tolist())
               for n in range(6)])
    out = tmp / "drafter"
    proc = subprocess.run(train_cmd(model_dir, data, out, "--epochs", "1", "--eval-every", "1000"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "6 training samples skipped" in proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["skipped_samples"] == 6 and summary["samples"] == 42
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert log and all(r["loss"] > 0 for r in log)
    # a data set grown in place would resume at the same batch index of another order: refused
    ds.append([({"id": f"{n:08x}eeeeeeee", "split": "train", "source": "test", "mode": "greedy",
                 "loss_ranges": [[4, 20]]}, torch.randint(0, 101, (20,), generator=gen).tolist()) for n in range(3)])
    proc = subprocess.run(train_cmd(model_dir, data, out, "--epochs", "2", "--eval-every", "1000"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trained on 42 samples, this run has 45" in proc.stderr


def test_token_alignable_loss_counts_a_step_only_where_the_earlier_steps_reached(tiny_setup):
    """GRIFFIN's mask (--align-topk): step j trains only where every earlier step had the target's
    token in its top-k; the total is the weighted sum of those masked steps."""
    from specdecode.training.trainer import TrainConfig, build_drafter
    from specdecode.training.ttt import (
        collate,
        needed_positions,
        shift_left,
        step_result,
        target_batch,
        ttt_forward,
        ttt_loss,
    )

    model_dir, data, tmp = tiny_setup
    target = load_hf_dir(model_dir, torch.float64, "cpu")
    ds = DataSet(data)
    rows = ds.samples("train")
    d2t, t2d, _ = draft_vocab(torch.bincount(torch.randint(0, 101, (500,), generator=torch.Generator().manual_seed(0)),
                                             minlength=101).numpy(), 64)
    t2d_index = torch.full((101,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(64)
    drafter = build_drafter(target, d2t, t2d, TrainConfig(data="", out="", init_from_target=False))
    tokens, valid, loss_mask = collate(ds, rows, list(range(8)), 64, None)
    tb = target_batch(target, tokens, needed_positions(valid, loss_mask), target.config.eagle3_aux_layer_ids, t2d,
                      t2d_index)
    outs = ttt_forward(drafter, tokens, valid, tb, 3)
    k = 24
    r0 = step_result(drafter, outs[0], tb, valid, loss_mask, 0, topk=k)
    assert r0.hit is not None and bool((r0.hit | ~r0.correct).all())  # top-1 right implies top-k right
    r1 = step_result(drafter, outs[1], tb, valid, loss_mask, 1, keep=r0.hit, topk=k)
    assert r1.hit is not None
    r2 = step_result(drafter, outs[2], tb, valid, loss_mask, 2, keep=r0.hit & r1.hit)
    every1 = shift_left(loss_mask & valid, 3, fill=False)
    assert r1.count == int((every1 & r0.hit).sum())
    assert 0 < r1.count < int(every1.sum())  # the mask removes some positions, not all
    assert 0 < r2.count < r1.count
    total, _, _, _ = ttt_loss(drafter, outs, tb, valid, loss_mask, 0.8, align_topk=k)
    torch.testing.assert_close(total, (r0.loss + 0.8 * r1.loss + 0.64 * r2.loss).float())
    plain, _, _, _ = ttt_loss(drafter, outs, tb, valid, loss_mask, 0.8)
    assert not torch.allclose(plain, total)


def test_tv_weight_mixes_the_total_variation_into_each_steps_loss(tiny_setup):
    """DSpark's loss (--tv-weight w): (1 - w) soft CE + w 0.5 sum |p - q|, computed here from the
    draft's logits and the target's probabilities directly; w = 0 is the CE alone."""
    from specdecode.training.trainer import TrainConfig, build_drafter
    from specdecode.training.ttt import collate, needed_positions, shift_left, step_result, target_batch, ttt_forward

    model_dir, data, tmp = tiny_setup
    target = load_hf_dir(model_dir, torch.float64, "cpu")
    ds = DataSet(data)
    d2t, t2d, _ = draft_vocab(torch.bincount(torch.randint(0, 101, (500,), generator=torch.Generator().manual_seed(0)),
                                             minlength=101).numpy(), 64)
    t2d_index = torch.full((101,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(64)
    drafter = build_drafter(target, d2t, t2d, TrainConfig(data="", out="", init_from_target=False))
    tokens, valid, loss_mask = collate(ds, ds.samples("train"), list(range(8)), 64, None)
    tb = target_batch(target, tokens, needed_positions(valid, loss_mask), target.config.eagle3_aux_layer_ids, t2d,
                      t2d_index)
    h = ttt_forward(drafter, tokens, valid, tb, 2)[1]
    ce = step_result(drafter, h, tb, valid, loss_mask, 1).loss
    b, i = shift_left(loss_mask & valid, 3, fill=False).nonzero(as_tuple=True)
    q = torch.softmax(drafter.lm_head(drafter.norm(h[b, i])).float(), -1)
    tv = 0.5 * (tb.probs[tb.row[b, i + 2]].float() - q).abs().sum(-1).mean()
    assert 0 < float(tv.detach()) < 1
    torch.testing.assert_close(step_result(drafter, h, tb, valid, loss_mask, 1, tv_weight=1.0).loss, tv)
    torch.testing.assert_close(step_result(drafter, h, tb, valid, loss_mask, 1, tv_weight=0.9).loss,
                               0.1 * ce + 0.9 * tv)
    with pytest.raises(ValueError, match="tv_weight"):
        TrainConfig(data="", out="", tv_weight=1.5)


def test_eval_data_is_evaluated_beside_the_held_out_split_and_not_selected_on(tiny_setup):
    """--eval-data: the same drafter at every evaluation on another data set's held-out answers, reported and kept,
    while training and the choice of the best checkpoint stay --data's: a copy of the held-out answers reads the
    run's own figure, another set its own, and the run trains exactly as without them."""
    import shutil

    model_dir, data, tmp = tiny_setup
    copy = tmp / "copy"
    shutil.copytree(data, copy)
    other = DataSet(tmp / "other")
    gen = torch.Generator().manual_seed(1)
    other.append([({"id": f"b{n:015x}", "split": "heldout", "source": "t", "mode": "greedy", "loss_ranges": [[4, 20]]},
                   torch.randint(0, 101, (20,), generator=gen).tolist()) for n in range(8)])
    (tmp / "other" / "manifest.json").write_text(json.dumps({"format": "specdecode-data-v1"}))
    runs = {}
    for name, extra in (("plain", ()), ("with", ("--eval-data", str(copy), str(tmp / "other")))):
        out = tmp / name
        proc = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "10", "--patience", "0", *extra),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (out, proc, json.loads((out / "checkpoint" / "trainer_state.json").read_text())["evals"])
    out, proc, evals = runs["with"]
    assert len(evals) == 2
    for e in evals:
        assert e["others"]["copy"]["accept_length"] == pytest.approx(e["accept_length"])
        assert e["others"]["copy"]["step_acc"] == pytest.approx(e["step_acc"])
        assert e["others"]["other"]["accept_length"] >= 1.0
    assert f"; copy {evals[-1]['accept_length']:.2f}; other " in proc.stderr
    plain_out, _, plain_evals = runs["plain"]
    assert [e["accept_length"] for e in plain_evals] == [e["accept_length"] for e in evals]
    assert (plain_out / "training_log.jsonl").read_text() == (out / "training_log.jsonl").read_text()
    assert all(torch.equal(a, b) for a, b in zip(load_file(str(plain_out / "model.safetensors")).values(),
                                                 load_file(str(out / "model.safetensors")).values(), strict=True))
    best = max(evals, key=lambda e: e["accept_length"])
    assert json.loads((out / "config.json").read_text())["specdecode_training"]["steps"] == best["step"]
    for bad, message in ((str(tmp / "absent"), "data build"), (str(copy) + " " + str(copy), "also named 'copy'")):
        failed = subprocess.run(train_cmd(model_dir, data, tmp / "d2", "--max-steps", "2", "--eval-data",
                                          *bad.split()), capture_output=True, text=True, timeout=300)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr[-500:]


def test_skip_samples_trains_on_the_later_samples_only(tiny_setup):
    """--skip-samples N leaves out the first N training samples (a continued run spends its steps on the answers
    its --init-from drafter has not seen): the draft vocabulary is that of the samples kept, and skipping them
    all is a clear error."""
    import numpy as np

    model_dir, data, tmp = tiny_setup
    ds = DataSet(data)
    train_rows, tokens = ds.samples("train"), ds.tokens()

    def vocab_of(rows):
        counts = np.zeros(101, dtype=np.int64)
        for r in rows:
            for a, b in r["loss_ranges"]:
                counts += np.bincount(tokens[r["offset"] + a: r["offset"] + b], minlength=101)
        return draft_vocab(counts, 16)[1]

    out = tmp / "drafter"
    proc = subprocess.run(train_cmd(model_dir, data, out, "--draft-vocab-size", "16", "--skip-samples", "30",
                                    "--limit-samples", "6", "--max-steps", "2", "--eval-every", "1000"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 6
    target = load_hf_dir(model_dir, torch.float32, "cpu")
    t2d = load_drafter(out, target).t2d.cpu()
    assert torch.equal(t2d, vocab_of(train_rows[30:36]))
    assert not torch.equal(t2d, vocab_of(train_rows[:6]))  # the check can tell the two apart
    proc = subprocess.run(train_cmd(model_dir, data, out, "--draft-vocab-size", "16", "--skip-samples", "31",
                                    "--limit-samples", "6", "--max-steps", "3", "--eval-every", "1000"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "skip_samples=30, this run has 31" in proc.stderr  # resumes only as it began
    alone = tmp / "alone"  # --skip-samples without --limit-samples: the vocabulary of every sample after the first N
    proc = subprocess.run(train_cmd(model_dir, data, alone, "--draft-vocab-size", "16", "--skip-samples", "30",
                                    "--max-steps", "1", "--eval-every", "1000"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["samples"] == len(train_rows) - 30
    vocab = load_drafter(alone, target).t2d.cpu()
    assert torch.equal(vocab, vocab_of(train_rows[30:])) and not torch.equal(vocab, vocab_of(train_rows))
    proc = subprocess.run(train_cmd(model_dir, data, tmp / "other", "--skip-samples", str(len(train_rows)),
                                    "--max-steps", "2"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"has only {len(train_rows)} training samples; skip fewer" in proc.stderr
    proc = subprocess.run(train_cmd(model_dir, data, tmp / "other", "--skip-samples", "-1", "--max-steps", "2"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "give numbers of samples >= 0" in proc.stderr


def test_train_refuses_an_out_that_holds_another_drafter_unless_overwrite(tiny_setup):
    """A trained drafter (no checkpoint of this run beside it) is not silently replaced: exit 2 and its
    files untouched; --overwrite empties the directory first, so no old acceptance table or model card
    is left beside the new weights."""
    model_dir, data, tmp = tiny_setup
    out = tmp / "taken"
    out.mkdir()
    for name, text in (("config.json", "{}"), ("acceptance.json", "{}"), ("README.md", "old card"),
                       (OUTPUT_MARKER, "")):  # a drafter an earlier run wrote
        (out / name).write_text(text)
    before = {p.name: p.read_text() for p in out.iterdir()}
    refused = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "2"), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and "Traceback" not in refused.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    done = subprocess.run(train_cmd(model_dir, data, out, "--max-steps", "2", "--overwrite"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not names & {"acceptance.json", "README.md"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
