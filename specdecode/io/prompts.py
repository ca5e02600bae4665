"""Prompt files, read in one place: a small built-in set for benchmarks, and jsonl in every
format we accept. Benchmarks (``load_prompts``) and drafter training data
(``specdecode.training.data``) both read through ``read_prompt_rows``.

Row formats (one JSON object a line):
- Spec-Bench / MT-Bench: ``turns`` (the first turn is used), ``question_id``, ``category``;
- ``{"prompt": ...}``: one user message;
- ``{"messages": [...]}``: chat messages as they are;
- ``{"conversations": [...]}``: SpecForge's (``role``/``content``) or ShareGPT's (``from``/``value``,
  ``human``/``gpt``) conversations: the system message(s) and the first user turn (the target
  answers it itself: its own answers are what a drafter trains on);
- self-instruct seed tasks / user-oriented instructions: ``instruction`` with ``instances``
  (``input``), or a plain ``input``: one user message per input, up to two of them;
- ``{"text": ...}``: raw text (no chat template).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...] | None = None  # chat messages (the template is applied)
    text: str | None = None  # raw text (no template)
    dropped_turns: int = 0  # assistant turns that opened its conversation, left out (as SpecForge does)


FORMATS = "'turns', 'messages', 'conversations', 'prompt', 'instruction' or 'text'"
# ShareGPT's speaker names (and SpecForge's roles) as chat roles
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
INSTANCES_PER_INSTRUCTION = 2  # an instruction with up to two of its inputs

BUILTIN = [
    ("writing", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("qa", "What causes the seasons on Earth?"),
    ("coding", "Write a Python function that checks whether a string is a palindrome, with a docstring."),
    ("math", "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step."),
    ("summarization", "Summarize the main ideas of the theory of evolution in a few sentences."),
    ("extraction", "List the planets of the solar system in order from the Sun, one per line."),
    ("roleplay", "You are a tour guide in Paris. Describe the Eiffel Tower to a group of visitors."),
    ("reasoning", "If all cats are mammals and some mammals are black, can we conclude that some cats are black?"),
]


def user(text: str) -> tuple[dict, ...]:
    """One user message."""
    return ({"role": "user", "content": text},)


def builtin_prompts() -> list[Prompt]:
    return [Prompt(f"builtin-{i}", cat, user(text)) for i, (cat, text) in enumerate(BUILTIN)]


def prompt_words(prompt: Prompt) -> int:
    """Whitespace-separated words in the prompt's messages (or text)."""
    parts = [str(m.get("content") or "") for m in prompt.messages] if prompt.messages else [prompt.text or ""]
    return sum(len(part.split()) for part in parts)


def load_prompts(path: str | Path | None, limit: int | None = None,
                 per_category: int | None = None, max_words: int | None = None) -> list[Prompt]:
    """The prompts of a file (any format above); None gives the built-in set.
    ``max_words`` first drops prompts of more words (``prompt_words``: a bound known before any
    tokenizer, e.g. to keep every request inside one compiled cache size); ``per_category`` keeps
    the first N of each category (a balanced sample), ``limit`` the first N overall."""
    prompts = read_prompts(path) if path is not None else builtin_prompts()
    if max_words is not None:
        if max_words < 1:
            raise ValueError(f"a prompt word limit must be >= 1; got {max_words}")
        kept_short = [p for p in prompts if prompt_words(p) <= max_words]
        if not kept_short:
            raise ValueError(f"no prompt of {path or 'the built-in set'} has at most {max_words} words; "
                             "raise the limit")
        prompts = kept_short
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, row) for each non-empty line, with errors that name the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found")
    # split on "\n" only: str.splitlines also breaks at U+2028, U+0085 and form feeds, which JSON
    # strings may hold unescaped (the shared corpus does: MMLU prompts)
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def is_spec_bench_row(row: dict) -> bool:
    return "turns" in row and "question_id" in row


def first_user_turn(conversation: Any, where: str) -> tuple[tuple[dict, ...], int]:
    """A SpecForge or ShareGPT conversation up to its first user turn, as chat messages, and how many
    assistant turns opened it (left out: SpecForge drops them too; many ShareGPT dumps start mid-chat)."""
    if not isinstance(conversation, list) or not all(isinstance(t, dict) for t in conversation):
        raise ValueError(f"{where}: 'conversations' must be a list of turns ({{'role', 'content'}} or "
                         "{'from', 'value'})")
    messages: list[dict] = []
    dropped = 0
    for turn in conversation:
        speaker = turn.get("role", turn.get("from"))
        role = ROLES.get(str(speaker).lower())
        if role is None:
            raise ValueError(f"{where}: unknown speaker {speaker!r} in 'conversations' (known: {', '.join(ROLES)})")
        content = turn.get("content", turn.get("value"))
        if not isinstance(content, str):
            raise ValueError(f"{where}: a turn of 'conversations' has no text ('content' or 'value')")
        if role == "assistant":
            if messages:  # an answer after a system message and before any user turn: not a chat we can ask
                break
            dropped += 1
            continue
        messages.append({"role": role, "content": content})
        if role == "user":
            return tuple(messages), dropped
    raise ValueError(f"{where}: 'conversations' has no user turn before the first answer")


def row_prompts(row: dict, n: int, path: str | Path) -> list[Prompt]:
    """The prompts of one row (line ``n`` of ``path``): one, or one per instance input."""
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object with a {FORMATS} field")
    pid = str(row.get("question_id", row.get("id", n)))
    category = str(row.get("category", "default"))
    if "turns" in row and row["turns"]:
        return [Prompt(pid, category, user(row["turns"][0]))]
    if "messages" in row:
        return [Prompt(pid, category, tuple(row["messages"]))]
    if "conversations" in row:
        messages, dropped = first_user_turn(row["conversations"], f"{path}:{n}")
        return [Prompt(pid, category, messages, dropped_turns=dropped)]
    if "instruction" in row:
        inputs = [i.get("input", "") for i in row.get("instances", [])] or [row.get("input", "")]
        return [Prompt(pid if k == 0 else f"{pid}-{k}", category,
                       user(row["instruction"] + (f"\n\n{inp}" if inp else "")))
                for k, inp in enumerate(inputs[:INSTANCES_PER_INSTRUCTION])]
    if "prompt" in row:
        return [Prompt(pid, category, user(row["prompt"]))]
    if "text" in row:
        return [Prompt(pid, category, text=row["text"])]
    raise ValueError(f"{path}:{n}: expected a {FORMATS} field")


def read_prompt_rows(path: str | Path) -> Iterator[tuple[int, dict, list[Prompt]]]:
    """(line number, row, its prompts) for each row of a prompt file: callers with a policy on
    rows (training refuses Spec-Bench) see the row beside what was read from it."""
    for n, row in read_jsonl(path):
        yield n, row, row_prompts(row, n, path)


def read_prompts(path: str | Path) -> list[Prompt]:
    prompts = [p for _, _, ps in read_prompt_rows(path) for p in ps]
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def encode_prompt(prompt: Prompt, tokenizer) -> list[int]:
    if prompt.messages is not None:
        return tokenizer.encode_chat(list(prompt.messages))
    return tokenizer.encode(prompt.text)
