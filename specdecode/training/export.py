"""A data set as SpecForge's training data: JSONL rows ``{"id", "conversations": [{role, content}, ...]}``.

Our samples store token ids (the chat template already applied), so each prompt is split back into
messages by the template's own layout: a conversation with marker strings is rendered once, and the
text around the markers (what precedes the system message, what lies between it and the user
message, what follows as the generation prompt) is looked for in the decoded prompt. Every
conversation written is checked: rendering its messages with the tokenizer's chat template gives
the stored prompt ids exactly, else the sample is left out and counted with the reason (a prompt
cut to its last tokens at build time has lost its beginning).

The system message is always written, the template's default included (SmolLM2's "You are a
helpful AI assistant named SmolLM, ..."): SpecForge keeps a conversation's own system message
("we will use the system prompt from the data") and inserts its template's only when there is
none, so this is what keeps the prompt the target answered. For SmolLM2 (ChatML) SpecForge's
``qwen`` template has the same assistant header and end of turn, which its loss mask needs.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.io.loading import resolve_model_dir
from specdecode.io.tokenizer import Tokenizer, load_tokenizer
from specdecode.training.dataset import DataSet

EXPORT_FORMATS = ("specforge",)
_SYSTEM, _USER = "\x00SYSTEM\x00", "\x00USER\x00"  # markers no real prompt contains


@dataclass(frozen=True)
class ChatLayout:
    """A single-turn chat template's text around its messages:
    ``before + system + between + user + after`` (``after`` is the generation prompt)."""

    before: str
    between: str
    after: str

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatLayout:
        text = tokenizer.chat_prompt([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}])
        if text.count(_SYSTEM) != 1 or text.count(_USER) != 1 or text.index(_SYSTEM) > text.index(_USER):
            raise ValueError("the chat template does not render a system and a user message in order; "
                             "this data set cannot be split back into messages")
        before, rest = text.split(_SYSTEM)
        between, after = rest.split(_USER)
        return cls(before, between, after)

    def split(self, prompt: str) -> tuple[str, str] | None:
        """(system, user) of a rendered single-turn prompt, or None when it is not one."""
        if not (prompt.startswith(self.before) and prompt.endswith(self.after)):
            return None
        body = prompt[len(self.before): len(prompt) - len(self.after)]
        if self.between not in body:
            return None
        system, user = body.split(self.between, 1)
        return system, user


def dataset_tokenizer(ds: DataSet, model: str | None = None) -> Tokenizer:
    """The tokenizer of the model that built ``ds`` (``model``, else the manifest's, else the default),
    refused when its chat template is not the one the data set was built with."""
    manifest = ds.manifest()
    source = model or (manifest.get("model") if Path(str(manifest.get("model", ""))).exists() else None)
    tokenizer = load_tokenizer(resolve_model_dir(source)[1])
    template = str(getattr(tokenizer.hf, "chat_template", ""))
    sha = hashlib.sha256(template.encode()).hexdigest()[:16]
    if manifest.get("chat_template_sha") not in (None, sha):
        raise ValueError(f"{ds.root} was built with another chat template ({manifest['chat_template_sha']}, this "
                         f"model's: {sha}); pass --model with the model that built it ({manifest.get('model')})")
    return tokenizer


@dataclass
class ExportSummary:
    written: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    cut_answers: int = 0  # answers that stopped at max_new_tokens (no end of turn)
    retokenized: int = 0  # answers whose text encodes to other ids than the target generated

    def as_dict(self) -> dict:
        return {"written": self.written, "skipped": dict(self.skipped), "answers_cut_at_max_tokens": self.cut_answers,
                "answers_retokenized_differently": self.retokenized}


def conversation(ids: list[int], answer_start: int, tokenizer: Tokenizer, layout: ChatLayout) -> list[dict] | str:
    """The sample's messages (system, user, assistant), or why it has none. The answer is text: a
    trainer that tokenizes it again may get other ids where the target chose a non-canonical
    split ('Wilk' + 'ins') or stopped inside a character (``ExportSummary.retokenized`` counts them)."""
    prompt_ids, answer_ids = ids[:answer_start], ids[answer_start:]
    parts = layout.split(tokenizer.decode(prompt_ids))
    if parts is None:
        return "the prompt is not a whole single-turn chat (cut to its last tokens at build time?)"
    messages = [{"role": "system", "content": parts[0]}, {"role": "user", "content": parts[1]}]
    if tokenizer.encode_chat(messages) != prompt_ids:
        return "its messages do not render back to the same prompt tokens"
    if answer_ids and answer_ids[-1] in tokenizer.eos_token_ids:
        answer_ids = answer_ids[:-1]
    return [*messages, {"role": "assistant", "content": tokenizer.decode(answer_ids)}]


CUT_ANSWERS = ("keep", "drop", "mark")
CUT_MARK = "answer_cut"  # the row field --cut-answers mark sets


def export_specforge(ds: DataSet, tokenizer: Tokenizer, out: Path, split: str | None = None,
                     on_progress: Callable[[int, int], None] | None = None, cut_answers: str = "keep",
                     ) -> ExportSummary:
    """Write ``ds``'s samples (``split``: train, heldout or None for all) to ``out`` as SpecForge
    JSONL; see the module docstring. An answer that stopped at the token limit has no end of turn,
    but SpecForge's template closes every assistant turn and trains that token: ``cut_answers``
    keeps such rows (counted), drops them (counted as skipped) or marks them (``"answer_cut": true``
    beside ``conversations``, for a filter of one's own)."""
    if cut_answers not in CUT_ANSWERS:
        raise ValueError(f"cut_answers={cut_answers!r}: use one of {', '.join(CUT_ANSWERS)}")
    layout = ChatLayout.of(tokenizer)
    rows = ds.samples(split)
    tokens = ds.tokens()
    summary = ExportSummary()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for n, row in enumerate(rows, 1):
            ids, _ = ds.read(row, tokens)
            ranges = row["loss_ranges"]
            if len(ranges) != 1 or ranges[0][1] != len(ids):
                summary.skipped["not one answer at the end of the sample"] += 1
                continue
            messages = conversation(ids, ranges[0][0], tokenizer, layout)
            if isinstance(messages, str):
                summary.skipped[messages] += 1
                continue
            cut = ids[-1] not in tokenizer.eos_token_ids
            summary.cut_answers += cut
            if cut and cut_answers == "drop":
                summary.skipped["the answer stopped at the token limit (--cut-answers drop)"] += 1
                continue
            answer = ids[ranges[0][0]:] if cut else ids[ranges[0][0]:-1]
            summary.retokenized += tokenizer.encode(messages[-1]["content"]) != answer
            record = {"id": row["id"], "conversations": messages} | ({CUT_MARK: True} if cut and cut_answers == "mark"
                                                                      else {})
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            summary.written += 1
            if on_progress is not None and (n % 500 == 0 or n == len(rows)):
                on_progress(n, len(rows))
    tmp.replace(out)
    return summary
