"""Drafts that cost no forward pass: the continuation of the request's own text where its last
tokens appeared before (prompt lookup / llama.cpp's ``ngram-simple``), for text that copies spans
of its prompt or of itself (summaries, RAG answers, edits, code).

``NgramIndex`` keeps, for every n-gram of ``min_n..max_n`` tokens seen so far that has a token after
it, where it last occurred. A proposal is what followed the longest n-gram the text now ends with.
``graft`` merges a proposal into a draft tree as a chain from the root: where it agrees with the
tree it follows the tree's nodes, where it leaves them it adds its own, so it extends the head's
chain when the two agree and adds a branch when they do not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

NGRAM_MIN = 2  # shortest suffix matched: one token alone repeats too often to be a copy
NGRAM_MAX = 6  # longest suffix tried first (the most specific match)


@dataclass(eq=False)
class NgramIndex:
    """The tokens of one request (prompt, then its output) and where each n-gram last occurred."""

    min_n: int = NGRAM_MIN
    max_n: int = NGRAM_MAX
    tokens: list[int] = field(default_factory=list)
    # n-gram -> index of the token that followed its latest occurrence
    _next: dict[tuple[int, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")

    def extend(self, tokens: Iterable[int]) -> None:
        t = self.tokens
        for token in tokens:
            i = len(t)  # every n-gram ending at i - 1 is followed by the token at i
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._next[tuple(t[i - n:i])] = i
            t.append(int(token))

    def propose(self, limit: int) -> list[int]:
        """``limit`` tokens that followed the longest earlier occurrence of the text's last n-gram (the
        latest such occurrence); [] when none occurred before. A copy that runs into the text's end goes
        on with what it proposed (a text repeating itself with a period shorter than ``limit``)."""
        return self.match(limit)[0]

    def match(self, limit: int) -> tuple[list[int], int]:
        """``propose``'s tokens and the length of the n-gram they follow (0: none)."""
        t, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._next.get(tuple(t[end - n:]))
            if start is not None:
                out: list[int] = []
                for k in range(start, start + limit):
                    out.append(t[k] if k < end else out[k - end])
                return out, n
        return [], 0
