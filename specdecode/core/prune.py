"""Each cycle's verify size from the proposers' confidence (``--verify-budget``): a node is worth verifying where
the tokens it is expected to add pay for what verifying it costs.

A node's chance of being accepted given its parent was is read from what the proposer knew of it, calibrated
by what this engine has seen accepted so far (``Calibration``: counts per bin, starting from the
proposer's own figure): the draft's probability of the token for the head's nodes, the match length and
rank for an n-gram proposal's. Its chance of being on the accepted path is the product along its path, and
a tree of b nodes is expected to give 1 + the sum over its best b - 1 nodes (each the most likely not yet
kept; a parent is never less likely than its child). ``VerifyBudget`` verifies the b, among the sizes the
trees allow, with the most tokens per millisecond over the batch: the rest of the cycle plus the verify of
b tokens a row, from the cost table measured at start-up (``core.costmodel.CycleCosts``). Rows keep their
own nodes up to that size (a batch verifies one size; fewer would be padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.core.speculative import Acceptance, DraftTree, select

DRAFT_BINS = 10  # the draft's probability in tenths
NGRAM_MATCH_BINS = 5  # n-gram match length 2..6+
NGRAM_RANK_BINS = 4  # rank in the proposal 1..4+
NGRAM_PRIOR = 0.3  # an n-gram node's chance before any was seen (near Spec-Bench's: 2026-12-07-free-drafts)


@dataclass
class Calibration:
    """Accepted over reached per bin, shrunk toward the proposer's own figure by ``prior`` observations."""

    bins: int
    prior: float = 4.0
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0.0] * self.bins
        self.accepted = self.accepted or [0.0] * self.bins

    def estimate(self, b: int, own: float) -> float:
        return (self.accepted[b] + self.prior * own) / (self.reached[b] + self.prior)

    def observe(self, b: int, accepted: bool) -> None:
        self.reached[b] += 1
        self.accepted[b] += accepted


def draft_bin(p: float) -> int:
    return min(int(p * DRAFT_BINS), DRAFT_BINS - 1)


def ngram_bin(match: int, rank: int) -> int:
    return min(max(match - 2, 0), NGRAM_MATCH_BINS - 1) * NGRAM_RANK_BINS + min(rank, NGRAM_RANK_BINS) - 1


@dataclass(eq=False)
class VerifyBudget:
    """The verify size of each cycle (``core.speculative.TreeBudget``). ``verify_ms(t)``: a verify of t tokens a
    row; ``rest_ms``: the rest of a cycle (draft, re-extend, bookkeeping). One per engine: it learns across
    requests (not thread-safe, as the engine)."""

    verify_ms: Callable[[int], float]
    rest_ms: float
    draft: Calibration = field(default_factory=lambda: Calibration(DRAFT_BINS))
    ngram: Calibration = field(default_factory=lambda: Calibration(NGRAM_MATCH_BINS * NGRAM_RANK_BINS))
    sizes: dict[int, int] = field(default_factory=dict)  # verify size chosen -> cycles
    # every this many cycles the whole trees are verified: what was pruned is never observed, so without it an
    # estimate that starts too low (a head whose probabilities understate it) would never be corrected
    explore_every: int = 16
    cycles: int = 0

    def chance(self, tree: DraftTree, i: int) -> float:
        """Node i's chance of acceptance given its parent's."""
        head = tree.confidence[i] if tree.confidence else 0.0
        p_head = self.draft.estimate(draft_bin(head), head) if head > 0 else 0.0
        if i not in tree.ngram_at:
            return p_head
        b = ngram_bin(*tree.ngram_at[i])
        p_ngram = self.ngram.estimate(b, NGRAM_PRIOR)
        return 1 - (1 - p_head) * (1 - p_ngram)  # both proposed it: either's evidence

    def ranked(self, tree: DraftTree) -> list[tuple[float, int]]:
        """(chance of being on the accepted path, node) of every drafted node, most likely first (a parent
        before its children)."""
        reach = [1.0] * tree.size
        for i in range(1, tree.size - tree.padding):
            reach[i] = reach[tree.parents[i]] * self.chance(tree, i)
        nodes = range(1, tree.size - tree.padding)
        return sorted(((reach[i], i) for i in nodes), key=lambda x: (-x[0], int(tree.depths[x[1]]), x[1]))

    def prune(self, trees: Sequence[DraftTree]) -> list[DraftTree]:
        self.cycles += 1
        largest = max(t.size for t in trees)
        if self.cycles % self.explore_every == 0:
            self.sizes[largest] = self.sizes.get(largest, 0) + 1
            return list(trees)
        ranked = [self.ranked(t) for t in trees]
        best, best_rate = largest, -1.0
        for size in range(1, largest + 1):
            expected = sum(1 + sum(p for p, _ in r[:size - 1]) for r in ranked)
            rate = expected / (self.rest_ms + self.verify_ms(size))
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = size, rate
        self.sizes[best] = self.sizes.get(best, 0) + 1
        if best == largest:
            return list(trees)
        return [select(t, [i for _, i in r[:best - 1]], best) for t, r in zip(trees, ranked, strict=True)]

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[Acceptance]) -> None:
        """Every node whose parent was accepted was reached: accepted or not, it is counted in its bins."""
        for tree, acc in zip(trees, accepted, strict=True):
            on_path = set(acc.path)
            for i in range(1, tree.size - tree.padding):
                if tree.parents[i] not in on_path:
                    continue
                ok = i in on_path
                head = tree.confidence[i] if tree.confidence else 0.0
                if head > 0:
                    self.draft.observe(draft_bin(head), ok)
                if i in tree.ngram_at:
                    self.ngram.observe(ngram_bin(*tree.ngram_at[i]), ok)

    def summary(self) -> dict[str, object]:
        """What it chose and learned (for profiles and logs)."""
        rate = [round(a / r, 3) if r else math.nan for a, r in zip(self.draft.accepted, self.draft.reached,
                                                                      strict=True)]
        return {"verify_sizes": dict(sorted(self.sizes.items())), "draft_accept_by_tenth": rate}
