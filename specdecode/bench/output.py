"""What every bench method is: a name and ``run(prompt ids, max new tokens) -> RunOutput`` (the
tokens, the wall time, the time to the first token, and the method's own stats). ``bench.methods``
and ``bench.llamaserver`` both implement it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RunOutput:
    token_ids: list[int] | None  # None: not known (a server that sends only text)
    elapsed_s: float
    ttft_s: float
    stats: dict = field(default_factory=dict)
    num_tokens: int | None = None  # when token_ids is None: the count the server reported

    @property
    def count(self) -> int:
        return max(len(self.token_ids) if self.token_ids is not None else self.num_tokens or 0, 1)


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput: ...
