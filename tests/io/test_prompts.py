"""Prompt rows in the training-data formats of the field: SpecForge's and ShareGPT's conversations."""

import json

import pytest

from specdecode.io.prompts import load_prompts, prompt_words, read_prompts


def test_specforge_and_sharegpt_conversations_give_their_first_user_turn(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"id": "a", "conversations": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi?"},
                                      {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "More?"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "Because."}]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = read_prompts(f)
    assert (a.id, a.messages) == ("a", ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}))
    assert (b.id, b.messages) == ("b", ({"role": "user", "content": "Why?"},))


def test_a_conversation_that_opens_with_an_answer_asks_its_first_user_turn(tmp_path, caplog):
    """ShareGPT dumps often start mid-chat: the leading assistant turns are left out (as SpecForge does),
    counted, and said once per file; the file is not refused."""
    from specdecode.training.data import read_prompt_file

    f = tmp_path / "p.jsonl"
    rows = [{"conversations": [{"from": "gpt", "value": "Hi, how can I help?"}, {"from": "gpt", "value": "Hello?"},
                               {"from": "human", "value": "Why is the sky blue?"}, {"from": "gpt", "value": "..."}]},
            {"conversations": [{"from": "human", "value": "Name a colour."}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = read_prompts(f)
    assert a.messages == ({"role": "user", "content": "Why is the sky blue?"},) and a.dropped_turns == 2
    assert b.dropped_turns == 0
    with caplog.at_level("WARNING"):
        records = read_prompt_file(f)
    assert len(records) == 2 and "2 conversation(s) opened with an assistant turn" in caplog.text


@pytest.mark.parametrize("conversation,words", [
    ([{"from": "robot", "value": "x"}], "unknown speaker 'robot'"),
    ([{"from": "gpt", "value": "x"}], "no user turn before the first answer"),
    ([{"from": "system", "value": "s"}, {"from": "gpt", "value": "x"}, {"from": "human", "value": "q"}],
     "no user turn before the first answer"),
    ([{"from": "human"}], "has no text"),
    ("hello", "must be a list of turns"),
])
def test_a_bad_conversation_names_the_line_and_the_fault(tmp_path, conversation, words):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"conversations": conversation}) + "\n")
    with pytest.raises(ValueError, match=f"p.jsonl:1: .*{words}"):
        read_prompts(f)


def test_a_word_limit_applies_before_the_per_category_pick(tmp_path):
    rows = [{"turns": ["one two three four five"], "category": "a"}, {"turns": ["short one"], "category": "a"},
            {"turns": ["a b c d e f"], "category": "b"}, {"turns": ["tiny"], "category": "b"}]
    path = tmp_path / "spec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = load_prompts(path, per_category=1, max_words=2)
    assert [p.messages[0]["content"] for p in kept] == ["short one", "tiny"]
    assert [prompt_words(p) for p in load_prompts(path)] == [5, 2, 6, 1]
    with pytest.raises(ValueError, match="must be >= 1"):
        load_prompts(path, max_words=0)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "three words here"}) + "\n")
    with pytest.raises(ValueError, match="has at most 2 words; raise the limit"):
        load_prompts(long, max_words=2)
