"""Data sets built apart (another machine, a larger draw) and joined: `data build --skip-from`, `data merge`,
and the refusal to resume a data set with other generation settings."""

import json
import subprocess
import sys

import numpy as np
import pytest

from specdecode.training.data import check_resume
from specdecode.training.dataset import DataSet, merge

BASE = {"format": "specdecode-data-v1", "model": "m.gguf", "model_fingerprint": "f0", "chat_template_sha": "c0",
        "heldout_percent": 5.0, "dtype": "bfloat16", "weights": "q4", "prompt_files": ["a.jsonl"]}


def make_set(root, ids, start, **manifest):
    ds = DataSet(root)
    rows = []
    for n, pid in enumerate(ids):
        tokens = list(range(start + 10 * n, start + 10 * n + 5 + n))
        rows.append(({"id": pid, "split": "heldout" if pid.startswith("h") else "train", "source": "s",
                      "mode": "greedy", "loss_ranges": [[2, len(tokens)]]}, tokens))
    ds.append(rows)
    ds.write_manifest(BASE | manifest)
    return ds


def test_merge_keeps_order_and_tokens_and_leaves_repeated_prompts_out(tmp_path):
    a = make_set(tmp_path / "a", ["h1", "t1", "t2"], 0)
    b = make_set(tmp_path / "b", ["t2", "t3", "h2"], 1000, dtype="bfloat16", weights="native", device="cuda",
                 prompt_files=["b.jsonl"])
    counts = merge([a.root, b.root], tmp_path / "m")
    m = DataSet(tmp_path / "m")
    rows = m.index()
    assert [r["id"] for r in rows] == ["h1", "t1", "t2", "t3", "h2"]  # the first part first: its held-out first
    assert counts["duplicates_left_out"] == 1 and counts["samples"] == 5 and counts["heldout"] == 2
    # every sample reads the tokens it had in its own part (t2: a's, not b's)
    own = {r["id"]: (a, r) for r in a.index()} | {r["id"]: (b, r) for r in b.index()[1:]}
    for r in rows:
        ds, orig = own[r["id"]]
        assert m.read(r) == ds.read(orig)
    assert len(m.tokens()) == sum(r["length"] for r in rows)
    manifest = m.manifest()
    assert manifest["status"] == "merged" and manifest["model_fingerprint"] == "f0"
    assert manifest["prompt_files"] == ["a.jsonl", "b.jsonl"]
    assert [p["weights"] for p in manifest["parts"]] == ["q4", "native"] and manifest["parts"][1]["device"] == "cuda"


def test_merge_refuses_other_models_one_part_and_a_used_out(tmp_path):
    a = make_set(tmp_path / "a", ["t1"], 0)
    b = make_set(tmp_path / "b", ["t2"], 0, model_fingerprint="f1")
    with pytest.raises(ValueError, match="differ in model_fingerprint"):
        merge([a.root, b.root], tmp_path / "m")
    c = make_set(tmp_path / "c", ["t3"], 0, heldout_percent=10.0)
    with pytest.raises(ValueError, match="differ in heldout_percent"):
        merge([a.root, c.root], tmp_path / "m2")
    with pytest.raises(ValueError, match="at least two"):
        merge([a.root], tmp_path / "m3")
    with pytest.raises(ValueError, match="not empty"):
        merge([a.root, a.root], b.root)
    with pytest.raises(FileNotFoundError, match="data build"):
        merge([a.root, tmp_path / "absent"], tmp_path / "m4")


def test_merge_from_the_cli_and_its_refusal(tmp_path):
    a = make_set(tmp_path / "a", ["t1", "h1"], 0)
    b = make_set(tmp_path / "b", ["t2"], 50)
    run = [sys.executable, "-m", "specdecode", "data", "merge"]
    ok = subprocess.run(run + [str(a.root), str(b.root), "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["samples"] == 3
    again = subprocess.run(run + [str(a.root), str(b.root), "--out", str(tmp_path / "m")], capture_output=True,
                           text=True)
    assert again.returncode == 2 and "not empty; choose a new --out" in again.stderr


def test_resume_with_other_generation_settings_is_refused_naming_them():
    old = BASE | {"max_new_tokens": 256, "sampled_fraction": 0.0, "seed": 0, "temperature": 0.7}
    check_resume(old, old | {"sample": 48000, "temperature": 1.0}, "d")  # the draw grows; greedy: no temperature
    with pytest.raises(ValueError, match=r"weights 'q4' -> 'native'; max_new_tokens 256 -> 128.*data merge"):
        check_resume(old, old | {"weights": "native", "max_new_tokens": 128}, "d")
    with pytest.raises(ValueError, match="temperature 0.7 -> 1.0"):
        check_resume(old | {"sampled_fraction": 0.3}, old | {"sampled_fraction": 0.3, "temperature": 1.0}, "d")
    check_resume({"dtype": "bfloat16"}, old | {"max_prompt_tokens": 768}, "d")  # an older manifest lacks some
    with pytest.raises(ValueError, match="made by `data merge`.*--skip-from d"):
        check_resume({"status": "merged", "parts": [old]}, old, "d")


def test_merge_reads_a_part_with_a_torn_tail_and_rejects_rows_past_its_end(tmp_path):
    a = make_set(tmp_path / "a", ["t1", "h1"], 0)
    b = make_set(tmp_path / "b", ["t2"], 50)
    with open(b.tokens_path, "ab") as f:
        f.write(b"\x01\x02")  # a writer killed mid-token
    counts = merge([a.root, b.root], tmp_path / "m")
    assert counts["samples"] == 3 and len(DataSet(tmp_path / "m").tokens()) == sum(
        r["length"] for r in DataSet(tmp_path / "m").index())
    rows = a.index_path.read_text().splitlines()
    bad = json.loads(rows[-1]) | {"offset": 10_000}
    a.index_path.write_text("\n".join(rows[:-1] + [json.dumps(bad)]) + "\n")
    with pytest.raises(ValueError, match="past the end of tokens.bin"):
        merge([a.root, b.root], tmp_path / "m2")


@pytest.mark.model
def test_build_skips_prompts_of_another_set_and_refuses_other_settings(tmp_path):
    prompts = tmp_path / "p.jsonl"
    topics = ["the sea", "bread", "rain", "chess", "tea"]
    prompts.write_text("".join(json.dumps({"prompt": f"Name one fact about {t}."}) + "\n" for t in topics))
    build = [sys.executable, "-m", "specdecode", "data", "build", "--prompts", str(prompts), "--max-new-tokens", "3",
             "--batch-size", "4", "--sampled-fraction", "0", "--dtype", "bfloat16", "--weights", "q4",
             "--compile", "off", "--threads", "1", "--seed", "3", "--heldout-percent", "10", "--sample", "5",
             "--max-prompt-tokens", "500", "--temperature", "0.5", "--top-p", "0.8"]
    first = subprocess.run(build + ["--out", str(tmp_path / "a"), "--limit", "2"], capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run(build + ["--out", str(tmp_path / "b"), "--skip-from", str(tmp_path / "a")],
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    a, b = DataSet(tmp_path / "a"), DataSet(tmp_path / "b")
    ids_a, ids_b = {r["id"] for r in a.index()}, {r["id"] for r in b.index()}
    assert len(ids_a) == 2 and len(ids_b) == 3 and not ids_a & ids_b
    assert b.manifest()["skip_from"] == [str(tmp_path / "a")] and b.manifest()["max_prompt_tokens"] == 500
    other = subprocess.run(build + ["--out", str(tmp_path / "a"), "--max-new-tokens", "5"], capture_output=True,
                           text=True, timeout=300)
    assert other.returncode == 2 and "max_new_tokens 3 -> 5" in other.stderr and "data merge" in other.stderr
    assert {r["id"] for r in a.index()} == ids_a  # nothing added
    missing = subprocess.run(build + ["--out", str(tmp_path / "c"), "--skip-from", str(tmp_path / "nothing")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--skip-from" in missing.stderr and not (tmp_path / "c").exists()
    merged = merge([a.root, b.root], tmp_path / "m")
    assert merged["samples"] == 5 and np.asarray(DataSet(tmp_path / "m").tokens()).max() < 49152
    # --like reads back what a build's manifest records: the same draw and settings, without the flags
    like = subprocess.run([sys.executable, "-m", "specdecode", "data", "build", "--like", str(tmp_path / "a"),
                           "--out", str(tmp_path / "l"), "--limit", "1", "--batch-size", "4", "--dtype", "bfloat16",
                           "--weights", "q4", "--compile", "off", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert like.returncode == 0, like.stderr[-2000:]
    made, copied = a.manifest(), DataSet(tmp_path / "l").manifest()
    for key in ("prompt_files", "sample", "max_new_tokens", "max_prompt_tokens", "sampled_fraction", "temperature",
                "top_p", "heldout_percent", "seed", "category_weights"):
        assert copied.get(key) == made.get(key), key
    assert (made["seed"], made["sample"], made["max_prompt_tokens"]) == (3, 5, 500)  # not the defaults


@pytest.mark.model
def test_a_stopped_build_keeps_the_answers_it_finished(tmp_path, monkeypatch):
    """Ctrl-C, or SIGTERM (the CLI turns it into the same KeyboardInterrupt: `timeout`, a scheduler), in the
    middle of a batch: the answers finished so far are saved, though fewer than --batch-size, and the same
    command resumes with the rest."""
    from specdecode.runtime.session import RuntimeConfig, start
    from specdecode.training import data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in ("yes", "no", "maybe", "hi")))
    session = start(RuntimeConfig(dtype="bfloat16", weights="q4", compile="off", threads=1))
    cfg = data.DataBuildConfig(out=str(tmp_path / "d"), prompts=(str(prompts),), max_new_tokens=3, batch_size=64,
                               sampled_fraction=0.0)

    def stopped_after_two(model, prompt_ids, options, eos, batch, on_done, runner=None):
        for i in range(2):
            on_done(i, [42, 43])
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "generate_all", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        data.build(cfg, session)
    ds = DataSet(tmp_path / "d")
    assert len(ds.index()) == 2 and len(ds.tokens()) == sum(r["length"] for r in ds.index())
    monkeypatch.undo()
    summary = data.build(cfg, session)
    assert summary["samples"] == 4 and summary["generated_this_run"] > 0


@pytest.mark.model
def test_a_resumed_build_is_the_data_set_an_uninterrupted_one_is(tmp_path, monkeypatch):
    """Each answer is saved as it finishes, and a resumed build gives every prompt the order, mode and seed
    an uninterrupted build gives it (they were drawn over the prompts left, so a sampled answer changed)."""
    from specdecode.runtime.session import RuntimeConfig, start
    from specdecode.training import data

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in "abcdefgh"))
    session = start(RuntimeConfig(dtype="bfloat16", weights="q4", compile="off", threads=1))

    def config(out):
        return data.DataBuildConfig(out=str(tmp_path / out), prompts=(str(prompts),), max_new_tokens=3,
                                    batch_size=64, sampled_fraction=0.5, seed=7, limit=6)

    def fake_generate(out, stop_after=None):
        ds = DataSet(tmp_path / out)
        before = len(ds.index()) if ds.exists() else 0

        def generate_all(model, prompt_ids, options, eos, batch, on_done, runner=None):
            for i, o in enumerate(options):
                if i == stop_after:
                    raise KeyboardInterrupt
                seed = o.sampling.seed
                on_done(i, [7 if seed is None else seed % 40000, len(prompt_ids[i])])
                assert len(ds.index()) == before + i + 1  # saved as it finished
        return generate_all

    monkeypatch.setattr(data, "generate_all", fake_generate("whole"))
    data.build(config("whole"), session)
    monkeypatch.setattr(data, "generate_all", fake_generate("cut", stop_after=3))
    with pytest.raises(KeyboardInterrupt):
        data.build(config("cut"), session)
    monkeypatch.setattr(data, "generate_all", fake_generate("cut"))
    data.build(config("cut"), session)

    def contents(name):
        ds = DataSet(tmp_path / name)
        return {r["id"]: (r["mode"], ds.read(r)[0]) for r in ds.index()}

    whole = contents("whole")
    assert len(whole) == 6 and {mode for mode, _ in whole.values()} == {"greedy", "sampled"}
    assert contents("cut") == whole


def test_the_cli_build_turns_sigterm_into_an_interrupt_once(tmp_path, monkeypatch):
    import signal

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text("")  # --prompts names files that exist

    from specdecode.cli import data as cli_data
    from specdecode.cli.main import main
    from specdecode.runtime import session as session_module
    from specdecode.training import data

    seen = {}

    def fake_build(cfg, session, on_progress=None):  # what SIGTERM does while the build runs
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        seen["after"] = signal.getsignal(signal.SIGTERM)
        return {"samples": 0}

    monkeypatch.setattr(session_module, "start", lambda *a, **k: None)
    monkeypatch.setattr(data, "build", fake_build)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["data", "build", "--out", str(tmp_path / "d"), "--prompts", "p.jsonl"]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == {"handler": cli_data._interrupt, "after": signal.SIG_IGN}


def test_an_append_finishes_before_sigterm_is_handled(tmp_path, monkeypatch):
    """A SIGTERM (or Ctrl-C) arriving mid-append is handled once the tokens and their index lines are both
    written: `data build`'s handler raises, which would otherwise leave tokens without index lines."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    ds = DataSet(tmp_path / "d")
    real = DataSet._append

    def signalled_first(self, rows):
        signal.raise_signal(signal.SIGTERM)  # arrives before anything is written
        real(self, rows)

    monkeypatch.setattr(DataSet, "_append", signalled_first)
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            ds.append([({"id": "t1", "split": "train", "source": "s", "mode": "greedy", "loss_ranges": [[1, 3]]},
                        [1, 2, 3])])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [r["id"] for r in ds.index()] == ["t1"] and list(ds.tokens()) == [1, 2, 3]


def test_build_like_takes_a_data_sets_draw_and_the_flags_given_win(tmp_path, monkeypatch, capsys):
    """`data build --like DATA`: DATA's prompt files (looked up by name under --prompts-dir when given, long/ kept)
    and settings (a merged set, merged again or not: its first part's); flags given as well win; clear errors
    otherwise."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text("")  # --prompts names files that exist
    import signal

    from specdecode.cli.main import main
    from specdecode.runtime import session as session_module
    from specdecode.training import data

    corpus = tmp_path / "corpus"
    (corpus / "long").mkdir(parents=True)
    for f in (corpus / "a.jsonl", corpus / "long" / "a.jsonl", corpus / "b.jsonl"):
        f.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    made = {"format": "specdecode-data-v1", "model_fingerprint": "f", "chat_template_sha": "t",
            "prompt_files": [str(corpus / "long/a.jsonl"), str(corpus / "a.jsonl")],  # not sorted: order is the draw's
            "sample": 48, "category_weights": {"coding": 2.0, "general": 0.5}, "max_new_tokens": 200,
            "max_prompt_tokens": 512, "sampled_fraction": 0.25, "temperature": 0.6, "top_p": 0.8,
            "heldout_percent": 4.0, "seed": 7, "dtype": "bfloat16", "weights": "q4"}

    def data_set(name, manifest, ids):
        ds = DataSet(tmp_path / name)
        ds.append([({"id": i, "split": "train", "source": "t", "mode": "greedy", "loss_ranges": [[1, 3]]}, [1, 2, 3])
                   for i in ids])
        ds.write_manifest(manifest)
        return ds.root

    a = data_set("a", made, ["a1"])
    b = data_set("b", made | {"seed": 9, "prompt_files": [str(corpus / "b.jsonl")]}, ["b1"])
    c = data_set("c", made | {"seed": 11}, ["c1"])
    merge([a, b], tmp_path / "m")
    merge([tmp_path / "m", c], tmp_path / "mm")  # merged again: its first part is itself merged
    assert "seed" not in DataSet(tmp_path / "mm").manifest()
    seen = []
    monkeypatch.setattr(session_module, "start", lambda *a, **k: None)
    monkeypatch.setattr(data, "build", lambda cfg, session, on_progress=None: seen.append(cfg) or {})
    before = signal.getsignal(signal.SIGTERM)  # the CLI's build installs its own handler

    def build(*flags):
        try:
            return main(["data", "build", "--out", str(tmp_path / "out"), *flags])
        finally:
            signal.signal(signal.SIGTERM, before)

    assert build("--like", str(a), "--sample", "96", "--top-p", "0.95") == 0
    cfg = seen[-1]
    assert cfg.prompts == (str(corpus / "long/a.jsonl"), str(corpus / "a.jsonl"))
    assert (cfg.sample, cfg.top_p) == (96, 0.95)  # given
    assert cfg.category_weights == (("coding", 2.0), ("general", 0.5))
    assert (cfg.max_new_tokens, cfg.max_prompt_tokens, cfg.sampled_fraction, cfg.temperature, cfg.heldout_percent,
            cfg.seed) == (200, 512, 0.25, 0.6, 4.0, 7)
    moved = tmp_path / "elsewhere"
    corpus.rename(moved)
    for merged in ("m", "mm"):
        assert build("--like", str(tmp_path / merged), "--prompts-dir", str(moved), "--seed", "3") == 0
        assert seen[-1].prompts == (str(moved / "long" / "a.jsonl"), str(moved / "a.jsonl"))  # a's files, in order
        assert (seen[-1].seed, seen[-1].max_new_tokens) == (3, 200)
    assert build("--prompts", "p.jsonl") == 0  # no --like: DataBuildConfig's defaults
    assert seen[-1].seed == data.DataBuildConfig(out="", prompts=()).seed and seen[-1].category_weights == ()
    capsys.readouterr()
    calls = len(seen)
    assert build("--like", str(a)) == 2  # its files are no longer where the manifest says
    assert "a.jsonl is not where its manifest says" in capsys.readouterr().err
    assert build("--like", str(tmp_path / "nothing")) == 2
    assert "no data set there" in capsys.readouterr().err
    assert build() == 2 and "--prompts FILE" in capsys.readouterr().err
    assert build("--prompts", "p.jsonl", "--prompts-dir", str(moved)) == 2
    assert "give --like" in capsys.readouterr().err
    assert len(seen) == calls  # nothing was built


def test_a_build_in_the_background_logs_a_line_a_minute():
    """Where stderr is a file (a build of hours under nohup), a line as answers are saved, at most one a minute,
    and the last count at the end or when stopped, each one line however long, instead of a bar that draws nothing
    there."""
    import io

    from rich.console import Console

    from specdecode.cli.data import BuildDisplay
    from specdecode.training.data import BuildProgress

    out = io.StringIO()
    display = BuildDisplay(Console(file=out, soft_wrap=True), every=60)
    for done, seconds in ((0, 0.0), (64, 30.0), (128, 61.0), (192, 90.0), (256, 125.0), (300, 140.0)):
        display(BuildProgress("generate", done, 300, new_tokens=done * 200, seconds=seconds))
    display.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" answers")[0] for line in lines] == [
        "generated 0/300", "generated 128/300", "generated 256/300", "generated 300/300"]
    assert lines[-1] == "generated 300/300 answers in 140 s, 429 new tok/s"
    out = io.StringIO()  # stopped (SIGTERM) 20 s after its last line: close() says the count it had reached
    display = BuildDisplay(Console(file=out, soft_wrap=True), every=60)
    for done, seconds in ((0, 0.0), (64, 70.0), (128, 90.0)):
        display(BuildProgress("generate", done, 300, new_tokens=done * 200, seconds=seconds))
    display.close()
    display.close()  # once
    assert [line.split(" answers")[0] for line in out.getvalue().splitlines()] == [
        "generated 0/300", "generated 64/300", "generated 128/300"]
