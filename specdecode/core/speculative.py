"""EAGLE-3 speculative decoding: draft -> verify -> accept -> re-extend.

Each phase is a function with typed inputs and outputs; the loop in ``eagle3_decode``
only wires them together. Index conventions (n = tokens in the target cache at the
start of a cycle; the root is the last accepted token, not yet in the target cache):

- target: the root sits at position n, a tree node of depth d at position n + d;
- draft: slot/position i holds the pair (target hidden at position i, token at i+1),
  so the draft cache holds n pairs and the root's pair (hidden n-1, root) is the last;
  a drafted node of depth d is the pair (its parent's draft hidden, its token) at n-1+d.

The tree follows EAGLE-2 with SGLang's parameters: ``num_steps`` (depth), ``topk``
(branching), ``num_draft_tokens`` (nodes verified, root included).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import Tensor

from specdecode.core.engine import DecodeStep, check_context
from specdecode.core.kvcache import KVCache
from specdecode.core.model import Transformer
from specdecode.core.profiler import CycleRecord, PhaseClock, TimeMeter
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

    It is what ``specdecode sweep`` measured best with the shipped drafter (v3) on Spec-Bench
    (bf16 native weights, 2 threads, steps 1-4 x topk 1-2; benchmarks/results/drafter-v3/sweep-bf16):
    two draft steps with the top 2 candidates each, 5 tokens verified: 1.33x measured (cost
    model 1.38x), accept length 1.90. At q4 weights one draft step was faster (1.16x against
    1.01x): the best shape depends on the format's verify cost, hence ``auto``.
    """

    num_steps: int = 2
    topk: int = 2
    # None (the default): every drafted node (chain: num_steps + 1), filled in by __post_init__.
    # Typed int because every built config holds one; the None default is the "derive it" marker.
    num_draft_tokens: int = cast(int, None)

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"num_steps ({self.num_steps}) and topk ({self.topk}) must be >= 1")
        most = max_draft_tokens(self.num_steps, self.topk)
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", default_draft_tokens(self.num_steps, self.topk))
        if not 2 <= self.num_draft_tokens <= most:
            raise ValueError(
                f"num_draft_tokens must be in [2, {most}] for num_steps={self.num_steps}, topk={self.topk} "
                f"(root + topk + (num_steps-1)*topk^2 candidates); got {self.num_draft_tokens}")

    @property
    def max_depth(self) -> int:
        return min(self.num_steps, self.num_draft_tokens - 1)


class AuxLayerConfig(Protocol):
    """The part of a drafter's config the loop reads: which target layers' inputs to tap."""

    @property
    def aux_layer_ids(self) -> tuple[int, ...]: ...


class Drafter(Protocol):
    """What the speculative loop needs of a drafter: ``Eagle3Drafter`` (the EAGLE-3 head) and
    ``SelfDrafter`` (a full model proposing its own tokens) are both one.

    Calling it runs one draft step over ``tokens`` [B, T] paired with ``hidden`` [B, T, ...] at
    ``positions``, appending to ``cache``; it returns draft-vocabulary logits [B, T, Vd] and
    the hidden state the next step feeds back. ``to_target_ids`` maps draft ids to target ids.
    """

    @property
    def config(self) -> AuxLayerConfig: ...

    def new_cache(self, max_len: int, batch_size: int = 1) -> KVCache: ...

    def to_target_ids(self, draft_ids: Tensor) -> Tensor: ...

    def __call__(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
                 attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


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
    parents: list[int]  # parent node index per node (-1 for the root); parents precede children
    depths: Tensor  # [N]
    mask: Tensor  # [N, N] bool: ancestor-or-self

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p].append(i)
        return kids


@dataclass
class Verification:
    logits: Tensor  # [N, V] target logits at each node
    hidden: Tensor  # [N, n_aux * H] fused target taps at each node


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


# ---------------------------------------------------------------- phases

def extend_draft(drafter: Drafter, cache: KVCache, target_hidden: Tensor, next_tokens: Tensor,
                 start_position: int) -> DraftState:
    """Run the draft over pairs (target hidden at position p, token at p+1), p from
    ``start_position``: after prefill over the whole prompt, after each cycle over the
    accepted path. Returns the draft's prediction at the last pair (the new root)."""
    T = next_tokens.numel()
    positions = torch.arange(start_position, start_position + T, device=next_tokens.device)
    logits, hidden = drafter(next_tokens.view(1, T), target_hidden.view(1, T, -1), positions, cache)
    return DraftState(logits[0, -1], hidden[0, -1])


def draft_tree(drafter: Drafter, cache: KVCache, state: DraftState, root: int, root_position: int,
               config: SpecConfig) -> DraftTree:
    """EAGLE-2 dynamic tree: expand the top-k frontier by cumulative log-prob for
    ``num_steps`` levels, then keep the best ``num_draft_tokens - 1`` nodes.

    Draft forwards write scratch entries after ``cache.length``; the cache length is
    restored on return (re-extend overwrites them)."""
    device, k = state.logits.device, config.topk
    prefix = cache.length  # everything up to and including the root's pair
    logp = torch.log_softmax(state.logits.float(), -1)
    score, draft_ids = logp.topk(k)
    # candidate arrays (all depths); a candidate's parent is a candidate index, -1 = root
    cand_ids, cand_score, cand_parent, cand_depth = [draft_ids], [score], [torch.full((k,), -1)], [1]
    frontier = torch.arange(k)  # candidate indices of the current frontier
    frontier_hidden = state.hidden.expand(k, -1)
    frontier_score, frontier_ids = score, draft_ids
    ancestors = torch.zeros(k, 0, dtype=torch.bool, device=device)  # frontier x scratch slots
    n_cand = k
    for depth in range(1, config.num_steps):
        scratch = cache.length - prefix
        mask = None  # a chain sees everything before it
        if k > 1:
            own = torch.eye(k, dtype=torch.bool, device=device)
            mask = torch.cat((torch.ones(k, prefix, dtype=torch.bool, device=device), ancestors, own),
                             dim=1).view(1, k, -1)
        positions = torch.full((k,), root_position - 1 + depth, device=device)
        logits, hidden = drafter(drafter.to_target_ids(frontier_ids).view(1, k), frontier_hidden.view(1, k, -1),
                                 positions, cache, attention_mask=mask)
        logp = torch.log_softmax(logits[0].float(), -1)
        child_logp, child_ids = logp.topk(k, dim=-1)  # [k, k]
        child_score = (frontier_score[:, None] + child_logp).flatten()
        child_parent = frontier.repeat_interleave(k)
        cand_ids.append(child_ids.flatten())
        cand_score.append(child_score)
        cand_parent.append(child_parent)
        cand_depth.append(depth + 1)
        best = child_score.topk(k).indices  # the next frontier among the k*k children
        rows = best // k  # which frontier node each came from
        slot_of_row = torch.arange(scratch, scratch + k, device=device)
        new_anc = torch.zeros(k, cache.length - prefix, dtype=torch.bool, device=device)
        new_anc[:, :scratch] = ancestors[rows]
        new_anc[torch.arange(k), slot_of_row[rows]] = True
        ancestors = new_anc
        frontier = n_cand + best
        frontier_hidden = hidden[0, rows]
        frontier_score, frontier_ids = child_score[best], child_ids.flatten()[best]
        n_cand += k * k
    cache.truncate(prefix)

    ids = torch.cat(cand_ids)
    scores = torch.cat(cand_score)
    parents = torch.cat([p.to(device) for p in cand_parent])
    depths = torch.cat([torch.full((len(c),), d, device=device) for c, d in zip(cand_ids, cand_depth, strict=False)])
    # Rank by score, shallower first on ties: a parent always outranks its children
    # (log-probs are <= 0), so any top-m set is a tree.
    order = sorted(range(len(ids)), key=lambda i: (-float(scores[i]), int(depths[i]), i))
    chosen = sorted(order[:config.num_draft_tokens - 1])  # candidate order: parents first
    node_of = {c: j + 1 for j, c in enumerate(chosen)}
    node_parents = [-1] + [node_of.get(int(parents[c]), 0) for c in chosen]
    tokens = torch.cat((torch.tensor([root], device=device), drafter.to_target_ids(ids[chosen])))
    node_depths = torch.cat((torch.zeros(1, dtype=torch.long, device=device), depths[chosen]))
    return DraftTree(tokens, node_parents, node_depths, ancestor_mask(node_parents, device))


def verify(target: Transformer, cache: KVCache, tree: DraftTree, aux_layers: Sequence[int]) -> Verification:
    """One target forward over every tree node (tree attention mask, positions by depth)."""
    n = cache.length
    out = target(tree.tokens.view(1, -1), n + tree.depths, cache, attention_mask=tree.mask,
                 hidden_layers=aux_layers)
    return Verification(out.logits[0], torch.cat(out.hidden_states, dim=-1)[0])


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


# ---------------------------------------------------------------- the loop

def spec_cache_sizes(target: Transformer, prompt_len: int, max_new_tokens: int,
                     shapes: Sequence[SpecConfig]) -> tuple[int, int]:
    """A request's target and draft cache sizes for the shapes it may decode with (the target's
    holds a verified tree past the new tokens, the draft's a tree's scratch entries)."""
    size = check_context(target, prompt_len, max_new_tokens, margin=max(s.num_draft_tokens for s in shapes))
    return size, size + max(s.num_steps * s.topk for s in shapes)


@torch.inference_mode()
def eagle3_decode(target: Transformer, drafter: Drafter, prompt_ids: Sequence[int], max_new_tokens: int,
                  sampling: SamplingParams, generator: torch.Generator | None, config: SpecConfig,
                  sync: bool = True, comm: TimeMeter | None = None,
                  policy: ShapePolicy | None = None) -> Generator[DecodeStep, None, None]:
    """The speculative loop; ``policy`` (optional) re-chooses the shape after every cycle."""
    device, aux = target.device, drafter.config.aux_layer_ids
    n = len(prompt_ids)
    size, dsize = spec_cache_sizes(target, n, max_new_tokens, [config, *(policy.shapes if policy else ())])
    tcache = target.new_cache(1, size)
    dcache = drafter.new_cache(dsize)
    clock = PhaseClock(device, sync, comm)

    clock.start()
    prompt = torch.tensor(prompt_ids, device=device)
    out = target(prompt.view(1, -1), torch.arange(n, device=device), tcache, hidden_layers=aux,
                 logits_at=torch.tensor([-1], device=device))
    root = int(sample(out.logits[0, -1], sampling, generator))
    next_tokens = torch.cat((prompt[1:], torch.tensor([root], device=device)))
    state = extend_draft(drafter, dcache, torch.cat(out.hidden_states, -1)[0], next_tokens, 0)
    yield DecodeStep([root], prefill_s=clock.finish()["total"])

    produced = 1
    while produced < max_new_tokens:
        clock.start()
        start = tcache.length
        tree = draft_tree(drafter, dcache, state, root, start, config)
        clock.mark("draft")
        ver = verify(target, tcache, tree, aux)
        clock.mark("verify")
        acc = accept_greedy(tree, ver) if sampling.greedy else accept_sampling(tree, ver, sampling, generator)
        tcache.keep(start, torch.tensor(acc.path, device=device) + start)
        new_tokens = acc.new_tokens(tree)
        clock.mark("other")  # acceptance and cache compaction
        state = extend_draft(drafter, dcache, ver.hidden[acc.path], torch.tensor(new_tokens, device=device), start)
        clock.mark("extend")
        root, produced = new_tokens[-1], produced + len(new_tokens)
        yield DecodeStep(new_tokens, CycleRecord(tree.size - 1, len(acc.path) - 1, clock.finish()))
        if policy is not None:
            config = policy.record(config, len(acc.path) - 1)


class Eagle3Decoder:
    """An ``Engine`` decoder: EAGLE-3 with a given drafter and tree configuration."""

    def __init__(self, drafter: Drafter, config: SpecConfig = SpecConfig(), sync: bool = True,
                 comm: TimeMeter | None = None, adapt: Callable[[], ShapePolicy] | None = None) -> None:
        self.drafter = drafter
        self.config = config  # the first cycle's shape (every cycle's without ``adapt``)
        self.sync = sync
        self.comm = comm  # tensor parallelism: all-reduce time becomes its own phase
        self.adapt = adapt  # a new shape policy per request (``core.costmodel.AdaptiveShape``)
        self.policies: list[ShapePolicy] = []  # the last request's policy (what it chose), for reports

    @property
    def max_depth(self) -> int:
        if self.adapt is None:
            return self.config.max_depth
        return max([self.config.max_depth, *(s.max_depth for s in self.adapt().shapes)])

    def __call__(self, target: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams, generator: torch.Generator | None) -> Generator[DecodeStep, None, None]:
        policy = self.adapt() if self.adapt else None
        self.policies = [policy] if policy else []
        return eagle3_decode(target, self.drafter, prompt_ids, max_new_tokens, sampling, generator,
                             self.config, self.sync, self.comm, policy)
