"""EAGLE-3 speculative decoding: draft -> verify -> accept -> re-extend.

Each phase is a function with typed inputs and outputs; ``spec_cycle`` wires them into one
cycle over a batch of rows, and ``core.batching.BatchEngine`` is the one loop that runs it.
Index conventions (n = tokens in the target cache at the start of a cycle; the root is the last
accepted token, not yet in the target cache):

- target: the root sits at position n, a tree node of depth d at position n + d;
- draft: slot/position i holds the pair (target hidden at position i, token at i+1),
  so the draft cache holds n pairs and the root's pair (hidden n-1, root) is the last;
  a drafted node of depth d is the pair (its parent's draft hidden, its token) at n-1+d.

The tree follows EAGLE-2 with SGLang's parameters: ``num_steps`` (depth), ``topk``
(branching), ``num_draft_tokens`` (nodes verified, root included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import Tensor

from specdecode.core.attention import rows_mask
from specdecode.core.kvcache import KVCache
from specdecode.core.model import Transformer
from specdecode.core.ngram import NgramIndex
from specdecode.core.profiler import CycleRecord, PhaseClock, TimeMeter
from specdecode.core.runner import EAGER, Drafter, MeteredRunner, StepRunner
from specdecode.core.sampling import SamplingParams, greedy_argmax, sample


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """The most tree nodes a draft can offer for verification: the root, ``topk`` children of
    the first step, then ``topk`` candidates for each of ``topk`` expanded nodes per later step."""
    return 1 + topk + (num_steps - 1) * topk ** 2


def default_draft_tokens(num_steps: int, topk: int) -> int:
    """Tokens verified when not given: a chain verifies all of it (``num_steps + 1``), a tree
    about one candidate per branch and step (``1 + num_steps * topk``), capped by the tree."""
    if topk == 1:
        return 1 + num_steps
    return min(max_draft_tokens(num_steps, topk), 1 + num_steps * topk)


@dataclass(frozen=True)
class SpecConfig:
    """One speculative configuration (a shape). ``SpecConfig()`` is the static default: what
    ``--spec-config static`` decodes with, and what ``--spec-config auto`` (the default everywhere,
    ``runtime.autospec``) falls back to for a drafter without an acceptance table.

    Two draft steps with the top 2 candidates each, 5 tokens verified: a sweep's best for an earlier
    drafter in bf16 native weights (benchmarks/results/drafter-v3/). The best shape depends on the
    drafter and on the format's verify cost, which is why ``auto`` chooses per machine.
    """

    num_steps: int = 2
    topk: int = 2
    # None (the default): every drafted node (chain: num_steps + 1), filled in by __post_init__.
    # Typed int because every built config holds one; the None default is the "derive it" marker.
    num_draft_tokens: int = cast(int, None)
    # Tokens a cycle may add from the request's own text (``core.ngram``: where its last tokens
    # appeared before), merged into the head's tree; 0: none.
    ngram: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"num_steps ({self.num_steps}) and topk ({self.topk}) must be >= 1")
        if self.ngram < 0:
            raise ValueError(f"ngram (tokens proposed from the text per cycle) must be >= 0, got {self.ngram}")
        most = max_draft_tokens(self.num_steps, self.topk)
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", default_draft_tokens(self.num_steps, self.topk))
        if not 2 <= self.num_draft_tokens <= most:
            raise ValueError(
                f"num_draft_tokens must be in [2, {most}] for num_steps={self.num_steps}, topk={self.topk} "
                f"(root + topk + (num_steps-1)*topk^2 candidates); got {self.num_draft_tokens}")

    @property
    def max_depth(self) -> int:
        """The deepest node a cycle verifies (the head's, or an n-gram proposal's)."""
        return max(min(self.num_steps, self.num_draft_tokens - 1), self.ngram)

    @property
    def max_tree(self) -> int:
        """Nodes a cycle verifies at most: the head's tree (the root included) and a proposal's own nodes."""
        return self.num_draft_tokens + self.ngram

    @property
    def margin(self) -> int:
        """Target cache slots a verify writes past a row's tokens: its largest tree."""
        return self.max_tree

    def to_dict(self) -> dict[str, int]:
        """The shape as results record it (``ngram`` only when on, so records of shapes without it read as before)."""
        out = {"num_steps": self.num_steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}
        return out | ({"ngram": self.ngram} if self.ngram else {})

    @property
    def label(self) -> str:
        """steps/topk/draft tokens, and the n-gram proposal's tokens: ``1/1/2+ngram6``."""
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}" + (f"+ngram{self.ngram}" if self.ngram else "")

    @property
    def draft_scratch(self) -> int:
        """Draft cache slots past a row's pairs: the tree levels' entries, and the scratch slot that
        padding of a batched re-extend writes."""
        return self.num_steps * self.topk + 1


def spec_margin(shapes: Sequence[SpecConfig]) -> int:
    """Target cache slots past a row's tokens that decoding with any of ``shapes`` needs (0: plain)."""
    return max((s.margin for s in shapes), default=0)


class ShapePolicy(Protocol):
    """Chooses each cycle's shape from the cycles run so far (``core.costmodel.AdaptiveShape``):
    one per request. ``shapes`` are all it may choose (the caches are sized for the largest)."""

    @property
    def shapes(self) -> Sequence[SpecConfig]: ...

    def record(self, shape: SpecConfig, accepted: int) -> SpecConfig: ...


@dataclass
class DraftState:
    """What the draft carries from one cycle to the next: its prediction at the root."""
    logits: Tensor  # [Vd] draft logits for the root's children
    hidden: Tensor  # [H] draft output hidden state at the root


@dataclass
class DraftTree:
    tokens: Tensor  # [N] target token ids; node 0 is the root
    parents: list[int]  # parent node index per node (-1 for the root and padding); parents precede children
    depths: Tensor  # [N]
    mask: Tensor  # [N, N] bool: ancestor-or-self
    ngram_nodes: frozenset[int] = frozenset()  # nodes only the n-gram proposal drafted
    padding: int = 0  # trailing nodes nobody drafted (rows of a batch verify trees of one size)
    # what the proposers knew of each node (``core.prune`` weighs it): the draft's probability of the node's
    # token after its parent (the root 1, a node the head did not draft 0; empty: not recorded), and for the
    # nodes on an n-gram proposal (shared ones included) its match length and the node's rank in it (1-based)
    confidence: tuple[float, ...] = ()
    ngram_at: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def drafted(self) -> int:
        return self.size - 1 - self.padding

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        return kids


@dataclass
class Verification:
    logits: Tensor  # [N, V] target logits at each node ([n, N, V] for a batch of rows)
    hidden: Tensor  # [N, n_aux * H] fused target taps at each node ([n, N, W] for a batch)


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, root first
    bonus: int  # the token the target chose after the last accepted node

    def new_tokens(self, tree: DraftTree) -> list[int]:
        return tree.tokens[self.path[1:]].tolist() + [self.bonus]


def ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(device)


def graft(tree: DraftTree, chain: Sequence[int], size: int | None = None, match: int = 0) -> DraftTree:
    """``tree`` with ``chain`` (tokens proposed after the root, ``core.ngram``, following an n-gram of
    ``match`` tokens) merged in from the root: a token a node already has as a child follows that child,
    the rest become new nodes, so the chain extends the tree's path where they agree and branches off where
    they part. Then padded to ``size`` nodes with nodes no path reaches (parent -1: never accepted, they
    see only themselves)."""
    tokens, parents, depths = tree.tokens.tolist(), list(tree.parents), tree.depths.tolist()
    real = tree.size - tree.padding
    tokens, parents, depths = tokens[:real], parents[:real], depths[:real]
    conf = list(tree.confidence[:real]) if tree.confidence else []
    kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True)) if p >= 0}
    own, at = set(tree.ngram_nodes), dict(tree.ngram_at)
    node = 0
    for k, t in enumerate(chain, 1):
        nxt = kids.get((node, t))
        if nxt is None:
            nxt = len(tokens)
            tokens.append(t)
            parents.append(node)
            depths.append(depths[node] + 1)
            conf += [0.0] if conf else []
            own.add(nxt)
            kids[(node, t)] = nxt
        at[nxt] = (match, k)
        node = nxt
    pad = max(0, (size or 0) - len(tokens))
    tokens += [tokens[0]] * pad
    parents += [-1] * pad
    depths += [0] * pad
    conf += [0.0] * pad if conf else []
    device = tree.tokens.device
    return DraftTree(torch.tensor(tokens, device=device), parents, torch.tensor(depths, device=device),
                     ancestor_mask(parents, device), frozenset(own), pad, tuple(conf), at)


def select(tree: DraftTree, keep: Sequence[int], size: int | None = None) -> DraftTree:
    """The subtree of nodes ``keep`` (the root and each kept node's parent among them), in their order,
    padded to ``size`` nodes as ``graft`` pads."""
    keep = sorted(set(keep) | {0})
    new = {old: i for i, old in enumerate(keep)}
    if any(tree.parents[i] >= 0 and tree.parents[i] not in new for i in keep):
        raise ValueError("a kept node's parent must be kept")
    parents = [new.get(tree.parents[i], -1) for i in keep]
    idx = torch.tensor(keep, device=tree.tokens.device)
    kept = DraftTree(tree.tokens[idx], parents, tree.depths[idx], ancestor_mask(parents, tree.tokens.device),
                     frozenset(new[i] for i in tree.ngram_nodes if i in new), 0,
                     tuple(tree.confidence[i] for i in keep) if tree.confidence else (),
                     {new[i]: v for i, v in tree.ngram_at.items() if i in new})
    return graft(kept, (), size) if size is not None and size > kept.size else kept


# ---------------------------------------------------------------- phases

@dataclass(eq=False, kw_only=True)
class SpecRow:
    """One request in the speculative cycle: what the drafter has yet to see and its draft state. Its
    place in the target and draft caches is row i of the caches a phase is given, whose lengths the
    caches keep (the target's: tokens before the root, the last token, which is not in it yet; the
    draft's: its entries, a self-drafter's one more than its pairs). A request decoded alone is a batch
    of one such row; continuous batching (``core.batching``) keeps one per slot."""

    sampling: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None
    root: int = -1
    dpairs: int = 0  # (hidden, token) pairs the drafter has seen = its next position
    pending_hidden: list[Tensor] = field(default_factory=list)  # target taps the drafter has not seen ...
    pending_tokens: list[int] = field(default_factory=list)  # ... paired with the next token of each
    state: DraftState | None = None  # the draft's prediction at the root
    ngram: NgramIndex | None = None  # the request's tokens up to the root, when n-gram proposals are on


def extend_draft(drafter: Drafter, cache: KVCache, target_hidden: Tensor, next_tokens: Tensor,
                 start_position: int, runner: StepRunner = EAGER) -> DraftState:
    """Run the draft over pairs (target hidden at position p, token at p+1), p from
    ``start_position``, appended to ``cache`` (one row): the prompt's pairs after prefill.
    Returns the draft's prediction at the last pair (the new root)."""
    T = next_tokens.numel()
    positions = torch.arange(start_position, start_position + T, device=next_tokens.device)
    logits, hidden = runner.draft(drafter, next_tokens.view(1, T), target_hidden.view(1, T, -1), positions, cache)
    return DraftState(logits[0, -1], hidden[0, -1])


def prefill(target: Transformer, cache: KVCache, row: SpecRow, prompt: Sequence[int], stop: int,
            aux_layers: Sequence[int], runner: StepRunner = EAGER) -> Tensor:
    """Prompt tokens ``[cache.length, stop)`` appended to ``cache`` (the row's: a one-row view of a pool);
    their taps wait for the drafter. Returns the logits after the last of them (the first new token's,
    once ``stop`` is the prompt's end)."""
    device, a = target.device, cache.length
    out = runner.target(target, torch.tensor([list(prompt[a:stop])], device=device),
                        torch.arange(a, stop, device=device), cache, hidden_layers=aux_layers,
                        logits_at=torch.tensor([-1], device=device))
    if aux_layers:
        row.pending_hidden.append(torch.cat(out.hidden_states, -1)[0])
        row.pending_tokens += prompt[a + 1:stop + 1]  # the pair of the last one waits for the next chunk (or the root)
    return out.logits[0, -1]


def start_draft(drafter: Drafter, cache: KVCache, row: SpecRow, root: int, runner: StepRunner = EAGER) -> None:
    """The row's first token is ``root``: the prompt's pairs through the drafter, appended to
    ``cache`` (the row's own, empty; a self-drafter puts the prompt's first token ahead)."""
    row.root = root
    row.pending_tokens.append(root)
    if cache.length != 0:
        raise ValueError("start_draft runs once per request, on its empty draft cache")
    row.state = extend_draft(drafter, cache, torch.cat(row.pending_hidden), torch.tensor(row.pending_tokens,
                             device=row.pending_hidden[0].device), row.dpairs, runner)
    row.dpairs = len(row.pending_tokens)
    row.pending_hidden, row.pending_tokens = [], []


def extend_rows(drafter: Drafter, cache: KVCache, rows: Sequence[SpecRow], runner: StepRunner = EAGER) -> None:
    """Every row's pending pairs (the last cycle's accepted path, or plain steps' taps) through
    the drafter in one forward: rows padded to the longest, padding written to the cache's
    scratch slot and masked out. Row i lives in row i of ``cache``."""
    counts = [len(r.pending_tokens) for r in rows]
    if not any(counts):
        return
    lengths = cache.lengths
    if any(c and not n for n, c in zip(lengths, counts, strict=True)):
        raise ValueError("a row's prompt goes through the drafter with start_draft first")
    n, device = len(rows), cache.k[0].device
    T = max(counts)
    t = torch.arange(T, device=device)
    starts = torch.tensor(lengths, device=device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if min(counts) == T:  # no padding (always so for a request alone): no padded copies to fill
        hidden = torch.stack([torch.cat(r.pending_hidden) for r in rows])
        tokens = torch.tensor([r.pending_tokens for r in rows], device=device)
        slots = starts[:, None] + t
        local = causal.expand(n, T, T)
    else:
        first = next(r for r in rows if r.pending_hidden).pending_hidden[0]
        hidden = torch.zeros(n, T, first.shape[-1], dtype=first.dtype, device=device)
        tokens = torch.zeros(n, T, dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            if counts[b]:
                hidden[b, :counts[b]] = torch.cat(row.pending_hidden)
                tokens[b, :counts[b]] = torch.tensor(row.pending_tokens, device=device)
        real = t[None, :] < torch.tensor(counts, device=device)[:, None]  # [n, T]
        slots = torch.where(real, starts[:, None] + t, cache.max_len)  # padding: the scratch slot
        local = causal & real[:, None, :]
    positions = torch.tensor([r.dpairs for r in rows], device=device)[:, None] + t
    mask = rows_mask(lengths, local, max(n + c for n, c in zip(lengths, counts, strict=True)))
    logits, out = runner.draft(drafter, tokens, hidden, positions, cache, attention_mask=mask, slots=slots)
    cache.advance(counts)
    for b, row in enumerate(rows):
        if counts[b]:
            row.state = DraftState(logits[b, counts[b] - 1], out[b, counts[b] - 1])
            row.dpairs += counts[b]
            row.pending_hidden, row.pending_tokens = [], []


def draft_rows(drafter: Drafter, cache: KVCache, rows: Sequence[SpecRow], config: SpecConfig,
               runner: StepRunner = EAGER) -> list[DraftTree]:
    """EAGLE-2 dynamic trees, one per row: expand the top-k frontier by cumulative log-prob for
    ``num_steps`` levels (every row's frontier in one draft forward per level), then keep each
    row's best ``num_draft_tokens - 1`` nodes.

    A level's frontier is written to the draft cache after the row's entries (slots
    ``length + (level - 1) * topk ...``) and sees the row's prefix, its ancestors and itself;
    nothing counts those entries afterwards (the next extend overwrites them)."""
    n, k = len(rows), config.topk
    states = [r.state for r in rows]
    if any(s is None for s in states):
        raise ValueError("every row needs the draft's prediction at its root (extend_rows first)")
    logits0 = torch.stack([s.logits for s in states if s is not None])  # [n, Vd]
    device = logits0.device
    score, draft_ids = torch.log_softmax(logits0.float(), -1).topk(k)  # [n, k]
    # candidates of every depth, per row; a candidate's parent is a candidate index, -1 = the root
    cand_ids, cand_score = [draft_ids], [score]
    cand_parent, cand_depth = [torch.full((n, k), -1, device=device)], [1]
    frontier = torch.arange(k, device=device).expand(n, k)  # candidate indices of the frontier
    f_hidden = torch.stack([s.hidden for s in states if s is not None])[:, None].expand(n, k, -1)
    f_score, f_ids = score, draft_ids
    prefix = cache.lengths  # up to and including the root's pair
    if config.num_steps > 1:
        own = torch.eye(k, dtype=torch.bool, device=device).expand(n, k, k)
        ancestors = torch.zeros(n, k, 0, dtype=torch.bool, device=device)  # frontier x earlier levels' entries
    n_cand = k
    for depth in range(1, config.num_steps):
        used = (depth - 1) * k  # entries of earlier levels
        mask = rows_mask(prefix, torch.cat((ancestors, own), -1), max(prefix) + used + k)
        # positions and slots from the rows' host counts: one small copy each, no arithmetic on the device (a
        # node of depth d is the pair at position n - 1 + d, n the target's tokens: the pairs seen, dpairs)
        positions = torch.tensor([[r.dpairs - 1 + depth] * k for r in rows], device=device)
        slots = torch.tensor([[p + used + j for j in range(k)] for p in prefix], device=device)
        logits, hidden = runner.draft(drafter, drafter.to_target_ids(f_ids), f_hidden, positions, cache,
                                      attention_mask=mask, slots=slots)
        child_logp, child_ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [n, k, k]
        child_score = (f_score[:, :, None] + child_logp).flatten(1)  # [n, k*k]
        cand_ids.append(child_ids.flatten(1))
        cand_score.append(child_score)
        cand_parent.append(frontier.repeat_interleave(k, dim=1))
        cand_depth.append(depth + 1)
        best = child_score.topk(k, dim=-1).indices  # [n, k]: the next frontier among the k*k children
        frontier = n_cand + best
        n_cand += k * k
        if k == 1:  # a chain: the one child goes on, every earlier entry is its ancestor
            ancestors = torch.ones(n, 1, used + 1, dtype=torch.bool, device=device)
            f_hidden, f_score, f_ids = hidden, child_score, child_ids.flatten(1)
            continue
        src = best // k  # which frontier node each came from
        new_anc = torch.zeros(n, k, used + k, dtype=torch.bool, device=device)
        new_anc[:, :, :used] = ancestors.gather(1, src[:, :, None].expand(n, k, used))
        new_anc.scatter_(2, used + src[:, :, None], True)
        ancestors = new_anc
        f_hidden = hidden.gather(1, src[:, :, None].expand(n, k, hidden.shape[-1]))
        f_score, f_ids = child_score.gather(1, best), child_ids.flatten(1).gather(1, best)

    if k == 1:  # a chain: every level's one candidate, in depth order, is what the ranking below would keep
        return _chain_trees(drafter, rows, torch.cat(cand_ids, 1), torch.cat(cand_score, 1),
                            config.num_draft_tokens - 1)
    ids, scores, parents = torch.cat(cand_ids, 1), torch.cat(cand_score, 1).tolist(), torch.cat(cand_parent, 1)
    depth_of = [d for c, d in zip(cand_ids, cand_depth, strict=True) for _ in range(c.shape[1])]
    depths = torch.tensor(depth_of, device=device)
    trees = []
    for b, row in enumerate(rows):
        # Rank by score, shallower first on ties: a parent always outranks its children
        # (log-probs are <= 0), so any top-m set is a tree.
        order = sorted(range(len(depth_of)), key=lambda i: (-scores[b][i], depth_of[i], i))
        chosen = sorted(order[:config.num_draft_tokens - 1])  # candidate order: parents first
        node_of = {c: j + 1 for j, c in enumerate(chosen)}
        row_parents = parents[b].tolist()
        node_parents = [-1] + [node_of.get(row_parents[c], 0) for c in chosen]
        pick = torch.tensor(chosen, device=device)
        tokens = torch.cat((torch.tensor([row.root], device=device), drafter.to_target_ids(ids[b, pick])))
        node_depths = torch.cat((torch.zeros(1, dtype=torch.long, device=device), depths[pick]))
        # the draft's probability of each node after its parent (scores are cumulative log-probs)
        conf = [math.exp(scores[b][c] - (scores[b][row_parents[c]] if row_parents[c] >= 0 else 0.0)) for c in chosen]
        trees.append(DraftTree(tokens, node_parents, node_depths, ancestor_mask(node_parents, device),
                               confidence=(1.0, *conf)))
    return trees


_CHAINS: dict[tuple[int, str], tuple[list[int], Tensor, Tensor]] = {}  # (nodes, device) -> parents, depths, mask


def _chain_trees(drafter: Drafter, rows: Sequence[SpecRow], ids: Tensor, scores: Tensor, m: int) -> list[DraftTree]:
    """Each row's chain of its first ``m`` drafted tokens (``ids``, ``scores``: [n, levels], cumulative
    log-probs), as ``draft_rows``' ranking builds it, without the ranking: a chain's nodes are its levels."""
    device = ids.device
    key = (m + 1, str(device))
    if key not in _CHAINS:  # the same for every chain of this length: made once
        parents = list(range(-1, m))
        _CHAINS[key] = (parents, torch.arange(m + 1, device=device), ancestor_mask(parents, device))
    parents, depths, mask = _CHAINS[key]
    targets = drafter.to_target_ids(ids[:, :m])
    roots = torch.tensor([[r.root] for r in rows], device=device)
    tokens = torch.cat((roots, targets), 1)
    # the draft's probability of each node after its parent (scores are cumulative log-probs)
    conf = torch.diff(scores[:, :m], dim=1, prepend=scores.new_zeros(len(rows), 1)).exp().tolist()
    return [DraftTree(tokens[b], parents, depths, mask, confidence=(1.0, *conf[b])) for b in range(len(rows))]


def verify_rows(target: Transformer, cache: KVCache, rows: Sequence[SpecRow], trees: Sequence[DraftTree],
                aux_layers: Sequence[int], runner: StepRunner = EAGER) -> Verification:
    """One target forward over every row's tree (per-row tree masks, positions by depth, the nodes
    written after each row's entries): logits [n, N, V] and fused taps [n, N, W]."""
    N, device = trees[0].size, target.device
    host = cache.lengths
    lengths = torch.tensor(host, device=device)
    slots = lengths[:, None] + torch.arange(N, device=device)  # [n, N]
    mask = rows_mask(host, torch.stack([t.mask for t in trees]), max(host) + N)
    positions = lengths[:, None] + torch.stack([t.depths for t in trees])
    out = runner.target(target, torch.stack([t.tokens for t in trees]), positions, cache, attention_mask=mask,
                        hidden_layers=aux_layers, slots=slots)
    return Verification(out.logits, torch.cat(out.hidden_states, dim=-1))


def accept_greedy(tree: DraftTree, ver: Verification, choice: list[int] | None = None) -> Acceptance:
    """Longest path whose every token is the target's argmax after its parent. ``choice``: that
    argmax per node when already computed (a batch takes it for every row in one call)."""
    choice = greedy_argmax(ver.logits).tolist() if choice is None else choice
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c] == choice[path[-1]]), None)
        if nxt is None:
            return Acceptance(path, choice[path[-1]])
        path.append(nxt)


def accept_sampling(tree: DraftTree, ver: Verification, params: SamplingParams,
                    generator: torch.Generator | None) -> Acceptance:
    """Speculative sampling for deterministic (top-k) draft candidates, exact for the target.

    At each node the target's own token is drawn from its distribution p there (``sample``,
    exactly as the baseline draws it); if a child holds that token the path goes on, else the
    draw is the bonus token. Every emitted token is a draw from p, so the output follows the
    target's distribution exactly; a child c is accepted with probability p(c), the same as
    the residual scheme for point-mass proposals (min(1, p/q) with q = 1, then renormalise),
    so nothing is lost in acceptance. And one draw per emitted token, in the baseline's
    order, means a seeded request gives the same tokens speculating or not, alone or in a
    batch (up to the float differences of the logits)."""
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        drawn = int(sample(ver.logits[path[-1]], params, generator))
        nxt = next((c for c in kids[path[-1]] if tokens[c] == drawn), None)
        if nxt is None:
            return Acceptance(path, drawn)
        path.append(nxt)


def accept_rows(cache: KVCache, rows: Sequence[SpecRow], trees: Sequence[DraftTree],
                ver: Verification) -> list[Acceptance]:
    """Each row's accepted path (greedy or sampled, its own parameters and generator); the path's
    entries compacted in the target cache, its taps and tokens left for the drafter, the bonus
    token the new root. ``ver``: the batch's (``verify_rows``)."""
    greedy = greedy_argmax(ver.logits).tolist() if any(r.sampling.greedy for r in rows) else []
    accepted = []
    for b, (row, tree) in enumerate(zip(rows, trees, strict=True)):
        mine = Verification(ver.logits[b], ver.hidden[b])
        acc = (accept_greedy(tree, mine, greedy[b]) if row.sampling.greedy
               else accept_sampling(tree, mine, row.sampling, row.generator))
        start = cache.lengths[b]
        cache.keep_row(b, start, torch.tensor(acc.path, device=ver.logits.device) + start)  # a chain's: in place
        new_tokens = acc.new_tokens(tree)
        row.pending_hidden.append(mine.hidden[acc.path])
        row.pending_tokens += new_tokens
        row.root = new_tokens[-1]
        accepted.append(acc)
    return accepted


# ---------------------------------------------------------------- the cycle

@dataclass
class CycleResult:
    """What one cycle gave each row (in order), and the phases' times for the whole batch."""
    tokens: list[list[int]]  # new tokens per row: the accepted path, then the bonus token
    records: list[CycleRecord]  # per row: drafted and accepted counts (times: the batch's, in ``times``)
    times: dict[str, float]


class TreeBudget(Protocol):
    """Chooses how much of each cycle's trees to verify from what the proposers knew of their nodes
    (``core.prune.VerifyBudget``), and learns from what was accepted. Verifying fewer nodes changes
    which tokens are tried, never which are accepted: losslessness is untouched."""

    def prune(self, trees: Sequence[DraftTree]) -> list[DraftTree]: ...

    def observe(self, trees: Sequence[DraftTree], accepted: Sequence[Acceptance]) -> None: ...


def spec_cycle(target: Transformer, drafter: Drafter, tcache: KVCache, dcache: KVCache, rows: Sequence[SpecRow],
               config: SpecConfig, clock: PhaseClock, runner: StepRunner = EAGER,
               budget: TreeBudget | None = None) -> CycleResult:
    """One speculative cycle over a batch of rows (row i in row i of both caches): the drafter
    catches up on what it has not seen -> every row drafts its tree (and grafts its n-gram proposal)
    -> ``budget`` keeps what pays to verify -> one target forward verifies them all -> each row accepts
    its path. A request decoded alone is a batch of one. The times include ``host`` (the cycle's time outside
    model calls) and ``calls`` (how many model calls it made)."""
    runner = MeteredRunner(runner, clock.wait if clock.sync else None)
    clock.start()
    extend_rows(drafter, dcache, rows, runner)
    clock.mark("extend")
    trees = draft_rows(drafter, dcache, rows, config, runner)
    if config.ngram:
        trees = propose_rows(rows, trees, config.ngram)
    if budget is not None:
        trees = budget.prune(trees)
    clock.mark("draft")
    ver = verify_rows(target, tcache, rows, trees, drafter.config.aux_layer_ids, runner)
    clock.mark("verify")
    accepted = accept_rows(tcache, rows, trees, ver)
    if budget is not None:
        budget.observe(trees, accepted)
    clock.mark("other")  # acceptance and cache compaction
    pairs = list(zip(accepted, trees, strict=True))
    times = clock.finish()
    times["host"], times["calls"] = max(0.0, times["total"] - runner.seconds), float(runner.calls)
    return CycleResult([a.new_tokens(t) for a, t in pairs],
                       [CycleRecord(t.drafted, len(a.path) - 1, {}, len(t.ngram_nodes),
                                    sum(i in t.ngram_nodes for i in a.path)) for a, t in pairs],
                       times)


def propose_rows(rows: Sequence[SpecRow], trees: Sequence[DraftTree], tokens: int) -> list[DraftTree]:
    """Each row's n-gram proposal of ``tokens`` grafted into its tree (``graft``), every tree padded to
    the largest (one verify over the batch)."""
    chains = [r.ngram.match(tokens) if r.ngram is not None else ([], 0) for r in rows]
    merged = [graft(t, c, match=n) for t, (c, n) in zip(trees, chains, strict=True)]
    size = max(t.size for t in merged)
    return [t if t.size == size else graft(t, (), size) for t in merged]


# ---------------------------------------------------------------- what to decode with

@dataclass(eq=False)
class Eagle3Decoder:
    """What an ``Engine`` decodes with: EAGLE-3 with ``drafter`` and a tree shape. The loop that runs it
    is the batch engine's (``core.batching.BatchEngine``: a request alone is a batch of one row)."""

    drafter: Drafter
    config: SpecConfig = field(default_factory=SpecConfig)  # the first cycle's shape (every cycle's without adapt)
    sync: bool = True  # CUDA: synchronize at phase boundaries (honest phase times)
    comm: TimeMeter | None = None  # tensor parallelism: all-reduce time becomes its own phase
    adapt: Callable[[], ShapePolicy] | None = None  # a new shape policy per request (core.costmodel.AdaptiveShape)
    runner: StepRunner = EAGER  # how steps run: eager, or compiled (runtime.decoders gives the session's)
    budget: TreeBudget | None = None  # how much of each cycle's trees to verify (core.prune); None: all of them

    @property
    def spec(self) -> SpecConfig:
        return self.config

    @property
    def shapes(self) -> list[SpecConfig]:
        """Every shape a request may decode with (caches are sized for the largest)."""
        return [self.config, *(self.adapt().shapes if self.adapt else ())]

    @property
    def max_depth(self) -> int:
        return max(s.max_depth for s in self.shapes)
