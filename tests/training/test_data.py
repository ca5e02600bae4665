"""Training prompts: read through specdecode.io.prompts, identified by content, Spec-Bench refused."""

import json

import pytest

from specdecode.training.data import SPEC_BENCH_HINT, dedupe, prompt_id, read_prompt_file


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_chat_format_is_read_and_identified_by_content(tmp_path):
    path = write_jsonl(tmp_path / "seeds.jsonl", [
        {"id": "seed_task_0", "instruction": "Sort these", "instances": [{"input": "3 1 2"}, {"input": "b a"},
                                                                          {"input": "z y"}]},
        {"instruction": "Say hi", "input": ""},
        {"prompt": "What is 2+2?"},
        {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]},
    ])
    records = read_prompt_file(path)
    texts = [r.messages[-1]["content"] for r in records]
    assert texts == ["Sort these\n\n3 1 2", "Sort these\n\nb a", "Say hi", "What is 2+2?", "Hello"]
    assert all(r.source == "seeds" for r in records)
    assert records[-1].messages == ({"role": "user", "content": "Hello"},)  # the target writes the answers
    assert records[3].id == prompt_id(({"role": "user", "content": "  what IS   2+2? "},))  # normalized


def test_dedupe_keeps_the_first_of_each_prompt(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Same"}, {"prompt": " same "}, {"prompt": "Other"}])
    assert [r.messages[0]["content"] for r in dedupe(read_prompt_file(path))] == ["Same", "Other"]


def test_spec_bench_is_refused(tmp_path):
    by_name = write_jsonl(tmp_path / "spec_bench_question.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match=SPEC_BENCH_HINT):
        read_prompt_file(by_name)
    by_rows = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Why?"]}])
    with pytest.raises(ValueError, match="q.jsonl:1: looks like Spec-Bench"):
        read_prompt_file(by_rows)


def test_raw_text_and_unknown_rows_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no chat turn to answer"):
        read_prompt_file(write_jsonl(tmp_path / "t.jsonl", [{"text": "raw"}]))
    with pytest.raises(ValueError, match="u.jsonl:1: expected a"):
        read_prompt_file(write_jsonl(tmp_path / "u.jsonl", [{"question": "?"}]))


def test_sample_by_category_shares_evenly_and_passes_on_the_rest(tmp_path):
    from specdecode.training.data import read_prompt_file, sample_by_category

    path = tmp_path / "corpus.jsonl"
    rows = ([{"prompt": f"math {i}", "category": "math"} for i in range(50)]
            + [{"prompt": f"poem {i}", "category": "writing:poetry"} for i in range(3)]
            + [{"prompt": f"code {i}", "category": "coding"} for i in range(20)])
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = read_prompt_file(path)
    assert {r.category for r in records} == {"math", "writing", "coding"}  # the coarse part
    picked = sample_by_category(records, 30, seed=1)
    counts = {c: sum(r.category == c for r in picked) for c in ("math", "writing", "coding")}
    assert counts == {"writing": 3, "coding": 13, "math": 14}  # writing has 3: its rest goes to the others
    assert len({r.id for r in picked}) == 30
    assert [r.id for r in sample_by_category(records, 30, seed=1)] == [r.id for r in picked]  # deterministic
    assert len(sample_by_category(records, 500, seed=1)) == 73  # never more than there are


def test_prompts_holding_unicode_line_separators_are_one_line(tmp_path):
    from specdecode.training.data import read_prompt_file

    # json.dumps(ensure_ascii=False) leaves U+2028 and U+0085 raw; JSONL lines end at "\n" only
    path = tmp_path / "mmlu.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c\x0cd", "category": "stem"}, ensure_ascii=False) + "\n"
                    + json.dumps({"prompt": "second"}) + "\n", encoding="utf-8")
    records = read_prompt_file(path)
    assert [r.messages[0]["content"] for r in records] == ["a\u2028b\x85c\x0cd", "second"]


def test_sample_by_category_weights_shares_and_nests(tmp_path):
    from specdecode.training.data import read_prompt_file, sample_by_category

    path = tmp_path / "corpus.jsonl"
    rows = ([{"prompt": f"math {i}", "category": "math"} for i in range(100)]
            + [{"prompt": f"code {i}", "category": "coding"} for i in range(100)]
            + [{"prompt": f"tr {i}", "category": "translation"} for i in range(100)])
    records = read_prompt_file(write_jsonl(path, rows))
    weights = {"coding": 2.0, "translation": 0.0}
    picked = sample_by_category(records, 60, seed=3, weights=weights)
    counts = {c: sum(r.category == c for r in picked) for c in ("math", "coding", "translation")}
    assert counts == {"math": 20, "coding": 40, "translation": 0}
    bigger = {r.id for r in sample_by_category(records, 120, seed=3, weights=weights)}
    assert {r.id for r in picked} <= bigger  # a larger draw keeps the smaller one's prompts
    assert [r.id for r in sample_by_category(records, 60, seed=3)] == [r.id for r in sample_by_category(
        records, 60, seed=3, weights={"math": 1.0})]  # weight 1.0 is the default
    with pytest.raises(ValueError, match="lack: poetry"):
        sample_by_category(records, 10, seed=0, weights={"poetry": 2.0})
