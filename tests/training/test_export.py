"""`data export --format specforge` (``training/export.py``): samples stored as token ids come back as
the messages the target answered, checked by rendering them again; what cannot is left out and counted."""

from __future__ import annotations

import hashlib
import json

import pytest

from specdecode.io.loading import resolve_model_dir
from specdecode.io.tokenizer import load_tokenizer
from specdecode.training.dataset import DataSet
from specdecode.training.export import ChatLayout, dataset_tokenizer, export_specforge
from tests.helpers import run_specdecode

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(None)[1])


def _sample(tokenizer, messages, answer, eos=True, keep_last=None):
    prompt = tokenizer.encode_chat(messages)
    if keep_last is not None:  # data build cuts long prompts to their last tokens
        prompt = prompt[-keep_last:]
    ids = prompt + tokenizer.encode(answer) + ([tokenizer.eos_token_ids[0]] if eos else [])
    return ids, len(prompt)


def _data_set(tmp_path, tokenizer, samples):
    ds = DataSet(tmp_path / "data")
    rows = []
    for n, (ids, start) in enumerate(samples):
        rows.append(({"id": f"s{n}", "split": "train" if n % 4 else "heldout", "source": "test", "mode": "greedy",
                      "loss_ranges": [[start, len(ids)]]}, ids))
    ds.append(rows)
    template = str(tokenizer.hf.chat_template)
    ds.write_manifest({"format": "specdecode-data-v1", "model": str(resolve_model_dir(None)[0]),
                       "chat_template_sha": hashlib.sha256(template.encode()).hexdigest()[:16]})
    return ds


def test_the_layout_splits_a_rendered_prompt_and_nothing_else(tokenizer):
    layout = ChatLayout.of(tokenizer)
    text = tokenizer.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}])
    assert layout.split(text) == ("Be brief.", "Hi\nthere")
    assert layout.split(tokenizer.chat_prompt("Why?")) == (SMOL_SYSTEM, "Why?")  # the template's default system
    assert layout.split(text[5:]) is None and layout.split(text[:-3]) is None


def test_export_writes_the_conversations_the_target_answered(tmp_path, tokenizer):
    user = [{"role": "user", "content": "Name three colours."}]
    system = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Bonjour ?"}]
    long = [{"role": "user", "content": "word " * 300}]
    ds = _data_set(tmp_path, tokenizer, [
        _sample(tokenizer, user, "Red, green and blue."),
        _sample(tokenizer, system, "Bonjour !"),
        _sample(tokenizer, user, "Red, green and", eos=False),  # stopped at max_new_tokens
        _sample(tokenizer, long, "Words.", keep_last=100),  # the prompt lost its beginning
        _sample(tokenizer, user, "Blue."),
    ])
    out = tmp_path / "sf.jsonl"
    summary = export_specforge(ds, tokenizer, out)
    assert summary.written == 4 and summary.cut_answers == 1 and summary.retokenized == 0
    assert list(summary.skipped.values()) == [1] and "cut to its last tokens" in next(iter(summary.skipped))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["s0", "s1", "s2", "s4"]
    assert rows[0]["conversations"] == [{"role": "system", "content": SMOL_SYSTEM}, *user,
                                        {"role": "assistant", "content": "Red, green and blue."}]
    assert rows[1]["conversations"] == [*system, {"role": "assistant", "content": "Bonjour !"}]
    # what SpecForge renders (the tokenizer's template, no generation prompt) holds the stored tokens
    index = {r["id"]: r for r in ds.index()}
    for row in rows:
        ids, _ = ds.read(index[row["id"]])
        rendered = tokenizer.encode(tokenizer.hf.apply_chat_template(row["conversations"], tokenize=False))
        assert rendered[:len(ids)] == ids
    # an answer cut at the token limit: left out, or marked for a filter of one's own
    dropped = export_specforge(ds, tokenizer, tmp_path / "d.jsonl", cut_answers="drop")
    assert dropped.written == 3 and dropped.skipped["the answer stopped at the token limit (--cut-answers drop)"] == 1
    assert "s2" not in (tmp_path / "d.jsonl").read_text()
    export_specforge(ds, tokenizer, tmp_path / "m.jsonl", cut_answers="mark")
    marked = {r["id"]: r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())}
    assert marked["s2"]["answer_cut"] is True and "answer_cut" not in marked["s0"]
    heldout = export_specforge(ds, tokenizer, tmp_path / "h.jsonl", split="heldout")
    written = [json.loads(line)["id"] for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert heldout.written == 2 and written == ["s0", "s4"]


def test_another_template_is_refused_and_the_cli_says_so(tmp_path, tokenizer):
    ds = _data_set(tmp_path, tokenizer, [_sample(tokenizer, [{"role": "user", "content": "Hi"}], "Hello.")])
    ds.write_manifest(ds.manifest() | {"chat_template_sha": "0123456789abcdef"})
    with pytest.raises(ValueError, match="another chat template.*--model"):
        dataset_tokenizer(ds)
    proc = run_specdecode("data", "export", str(ds.root), "--out", str(tmp_path / "x.jsonl"), check=False)
    assert proc.returncode == 2 and "another chat template" in proc.stderr and not (tmp_path / "x.jsonl").exists()
    missing = run_specdecode("data", "export", str(tmp_path / "none"), "--out", str(tmp_path / "x.jsonl"), check=False)
    assert missing.returncode == 2 and "data build" in missing.stderr
