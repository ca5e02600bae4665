"""Prompt sets for benchmarks: a small built-in set, Spec-Bench jsonl, or {"prompt": ...} jsonl."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...] | None = None  # chat messages (the template is applied)
    text: str | None = None  # raw text (no template)


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


def builtin_prompts() -> list[Prompt]:
    return [Prompt(f"builtin-{i}", cat, ({"role": "user", "content": text},))
            for i, (cat, text) in enumerate(BUILTIN)]


def load_prompts(path: str | Path | None, limit: int | None = None,
                 per_category: int | None = None) -> list[Prompt]:
    """Spec-Bench format (``turns``, ``category``: the first turn is used) or
    ``{"prompt": ...}`` / ``{"messages": [...]}`` lines; None gives the built-in set.
    ``per_category`` keeps the first N of each category (a balanced sample), ``limit``
    the first N overall."""
    prompts = _read_prompts(path) if path is not None else builtin_prompts()
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def read_jsonl(path: str | Path):
    """(line number, row) for each non-empty line, with errors that name the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None


def _read_prompts(path: str | Path) -> list[Prompt]:
    prompts = []
    for n, row in read_jsonl(path):
        pid = str(row.get("question_id", row.get("id", n)))
        category = str(row.get("category", "default"))
        if "turns" in row and row["turns"]:
            prompts.append(Prompt(pid, category, ({"role": "user", "content": row["turns"][0]},)))
        elif "messages" in row:
            prompts.append(Prompt(pid, category, tuple(row["messages"])))
        elif "prompt" in row:
            prompts.append(Prompt(pid, category, ({"role": "user", "content": row["prompt"]},)))
        elif "text" in row:
            prompts.append(Prompt(pid, category, text=row["text"]))
        else:
            raise ValueError(f"{path}:{n}: expected a 'turns', 'messages', 'prompt' or 'text' field")
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def encode_prompt(prompt: Prompt, tokenizer) -> list[int]:
    if prompt.messages is not None:
        return tokenizer.encode_chat(list(prompt.messages))
    return tokenizer.encode(prompt.text)
