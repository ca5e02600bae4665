"""The training-time test (TTT) of EAGLE-3: the target's side of a batch, the draft's
unrolled forward, its loss, and the acceptance it implies.

The target runs frozen inside the loop (online: no cached features). For each batch it
gives the fused aux hidden states and its next-token distribution restricted to the
draft vocabulary. The draft then unrolls ``ttt_steps`` steps: step 0 reads the target's
hidden states, step j>0 its own step j-1 output, with tokens shifted by j, exactly as at
inference. At step j, index i is the drafted node of depth j+1 whose real prefix ends at
i, so its query sees step-0 keys up to i (causal) plus its own chain (steps 1..j at i),
at RoPE position i + j. Loss: soft cross-entropy against the target's distribution,
weighted 0.8^j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specdecode.core.attention import apply_rope, rope_cos_sin
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.model import Transformer
from specdecode.training.dataset import DataSet


def collate(ds: DataSet, rows: list[dict], idx: list[int], max_len: int, tokens_mm: np.ndarray | None,
            device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """Samples ``idx`` of ``rows`` as (tokens, valid, loss mask) [B, T] on ``device``, cut at ``max_len``."""
    seqs = [ds.read(rows[i], tokens_mm) for i in idx]
    T = min(max(len(s[0]) for s in seqs), max_len)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    loss = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (ids, mask) in enumerate(seqs):
        n = min(len(ids), T)
        tokens[b, :n] = torch.tensor(ids[:n])
        valid[b, :n] = True
        loss[b, :n] = torch.tensor(mask[:n])
    return tokens.to(device), valid.to(device), loss.to(device)


# ---------------------------------------------------------------- target side

@dataclass
class TargetBatch:
    hidden: Tensor  # [B, T, n_aux*H] fused aux taps
    probs: Tensor  # [P, Vd] target probabilities restricted (renormalized) to the draft vocab
    row: Tensor  # [B, T] row of ``probs`` for each position (-1: not needed, not computed)
    best: Tensor  # [B, T] draft id of the target's argmax (-1 if outside the draft vocab / not computed)


@torch.no_grad()
def target_batch(target: Transformer, tokens: Tensor, needed: Tensor, aux: tuple[int, ...], t2d: Tensor,
                 target_to_draft: Tensor, chunk: int = 1024) -> TargetBatch:
    """Target forward; its distribution only at the ``needed`` [B, T] positions (those
    whose next token is trained on), which skips the lm_head over prompts."""
    B, T = tokens.shape
    n = target.config.num_layers
    dev = tokens.device
    out = target(tokens, torch.arange(T, device=dev), target.new_cache(B, T), hidden_layers=(*aux, n),
                 logits_at=torch.zeros(0, dtype=torch.long, device=dev))
    hidden = torch.cat(out.hidden_states[:-1], -1)
    where = needed.flatten().nonzero().squeeze(1)
    final = target.norm(out.hidden_states[-1].reshape(B * T, -1)[where])
    draft_logits, argmax = [], []
    for s in range(0, len(where), chunk):
        logits = target.lm_head(final[s:s + chunk]).float()
        argmax.append(logits.argmax(-1))
        draft_logits.append(logits[:, t2d])
    return assemble_target_batch(hidden, where, draft_logits, argmax, t2d, target_to_draft, B, T)


def assemble_target_batch(hidden: Tensor, where: Tensor, draft_logits: list[Tensor], argmax: list[Tensor],
                          t2d: Tensor, target_to_draft: Tensor, B: int, T: int) -> TargetBatch:
    """A ``TargetBatch`` from the target at the flat positions ``where`` (in order): its logits over
    the draft vocabulary and its greedy target ids there, chunk by chunk."""
    dev = hidden.device
    # probabilities kept in bf16: halves the memory traffic
    probs = [torch.softmax(z.float(), -1).to(torch.bfloat16) for z in draft_logits]
    best = [torch.where(t2d[a], target_to_draft[a], -1) for a in argmax]
    vd = int(t2d.sum())
    row = torch.full((B * T,), -1, dtype=torch.long, device=dev)
    row[where] = torch.arange(len(where), device=dev)
    best_full = torch.full((B * T,), -1, dtype=torch.long, device=dev)
    if len(where):
        best_full[where] = torch.cat(best)
    return TargetBatch(hidden, torch.cat(probs) if probs else torch.zeros(0, vd, device=dev), row.view(B, T),
                       best_full.view(B, T))


def needed_positions(valid: Tensor, loss_mask: Tensor) -> Tensor:
    """Positions p whose next token (p + 1) is a trained assistant token."""
    return shift_left(loss_mask & valid, 1, fill=False)


# ---------------------------------------------------------------- draft side (TTT)

def shift_left(x: Tensor, k: int, fill=0) -> Tensor:
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat((x[:, k:], pad), dim=1)


def ttt_forward(drafter: Eagle3Drafter, tokens: Tensor, valid: Tensor, tb: TargetBatch, steps: int) -> list[Tensor]:
    """The draft layer's outputs [B, T, H] for each unrolled step (see module docstring): what
    ``drafter.head`` turns into logits; the next step reads ``drafter.feedback`` of each."""
    c = drafter.config.layer
    attn = drafter.midlayer.self_attn
    B, T = tokens.shape
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    scale = 1.0 / math.sqrt(hd)
    embed = drafter.embed_tokens
    idx = torch.arange(T, device=tokens.device)
    causal = (idx[None, :] <= idx[:, None])[None, None] & valid[:, None, None, :]  # [B,1,T,T]
    hidden = drafter.fuse(tb.hidden.to(drafter.fc.weight.dtype))
    keys0 = values0 = hidden  # set at step 0, before any use
    chain_k: list[Tensor] = []
    chain_v: list[Tensor] = []
    outputs = []
    for j in range(steps):
        x_emb = embed(shift_left(tokens, 1 + j)).detach().to(hidden.dtype)
        x, residual = drafter.layer_input(x_emb, hidden)
        q, k, v = attn.qkv_proj(x).split(attn.split, dim=-1)
        q = q.view(B, T, nh, hd).transpose(1, 2)
        k = k.view(B, T, nkv, hd).transpose(1, 2)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(drafter.inv_freq, (idx + j).expand(B, T), q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        if j == 0:
            keys0, values0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        scores = (q @ keys0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k]  # own chain: same index only
        probs = torch.softmax(torch.cat([scores, *diag], -1).float(), -1).to(q.dtype)
        out = probs[..., :T] @ values0
        for n_, cv in enumerate(chain_v):
            out = out + probs[..., T + n_:T + n_ + 1] * cv
        h = drafter.layer_output(residual, attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))
        outputs.append(h)
        hidden = drafter.feedback(h)
    return outputs


@dataclass
class StepResult:
    loss: Tensor  # mean soft cross-entropy over counted positions
    correct: Tensor  # [B, T] bool: draft argmax == target argmax at counted positions
    count: int
    hit: Tensor | None = None  # [B, T] bool: the target's token among the draft's top-k (``topk`` given)


def step_result(drafter: Eagle3Drafter, h: Tensor, tb: TargetBatch, valid: Tensor, loss_mask: Tensor,
                j: int, keep: Tensor | None = None, topk: int = 0, tv_weight: float = 0.0) -> StepResult:
    """Step j at index i predicts token i+2+j against the target's distribution at i+1+j;
    it counts when that token exists and is an assistant token (and ``keep`` [B, T], if
    given, holds there). The lm_head runs only there; soft CE = logsumexp(z) - sum(p * z)
    (p sums to one). ``topk``: also say where the target's token is among the draft's
    ``topk`` most likely (``hit``). ``tv_weight`` w: the loss is (1 - w) CE + w TV, TV the
    total variation 0.5 sum |p - q| (1 - TV is the acceptance rate of sampled speculation;
    DSpark trains with w = 0.9)."""
    B, T = valid.shape
    ok = shift_left(loss_mask & valid, 2 + j, fill=False)
    if keep is not None:
        ok = ok & keep
    b, i = ok.nonzero(as_tuple=True)
    logits = drafter.head(h[b, i]).float()
    rows = tb.row[b, i + 1 + j]
    p = tb.probs[rows].float()
    cross = torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # sum(p * z) without the product tensor
    loss = (torch.logsumexp(logits, -1) - cross).mean() if len(b) else logits.sum() * 0
    if tv_weight and len(b):
        tv = 0.5 * (p - torch.softmax(logits, -1)).abs().sum(-1).mean()
        loss = (1 - tv_weight) * loss + tv_weight * tv
    target_ids = tb.best[b, i + 1 + j]
    correct = torch.zeros(B, T, dtype=torch.bool, device=valid.device)
    correct[b, i] = logits.argmax(-1) == target_ids
    hit = None
    if topk:
        hit = torch.zeros(B, T, dtype=torch.bool, device=valid.device)
        top = logits.detach().topk(min(topk, logits.shape[-1]), dim=-1).indices
        hit[b, i] = (top == target_ids.unsqueeze(-1)).any(-1)  # -1 (outside the draft vocabulary) never hits
    return StepResult(loss, correct, len(b), hit)


def ttt_loss(drafter: Eagle3Drafter, outputs: list[Tensor], tb: TargetBatch, valid: Tensor, loss_mask: Tensor,
             weight: float, align_topk: int = 0, tv_weight: float = 0.0,
             ) -> tuple[Tensor, list[float], list[float], list[Tensor]]:
    """The weighted loss over the unrolled steps, each step's loss and accuracy, and its ``correct`` map.
    ``tv_weight``: the share of total variation in each step's loss (``step_result``).

    ``align_topk`` > 0: GRIFFIN's token-alignable training. Step j (> 0) counts only at the
    positions where every earlier step put the target's token among its ``align_topk`` most
    likely, the positions a draft tree of that width reaches at inference; elsewhere the
    chain has already broken there and the step's prediction is never verified. Accuracies
    are then conditional on reaching the step (the held-out evaluation never aligns)."""
    total = outputs[0].new_zeros((), dtype=torch.float32)
    losses, accs, correct = [], [], []
    keep: Tensor | None = None
    for j, h in enumerate(outputs):
        r = step_result(drafter, h, tb, valid, loss_mask, j, keep, align_topk, tv_weight)
        total = total + weight ** j * r.loss
        losses.append(float(r.loss.detach()))
        accs.append(float(r.correct.sum()) / max(r.count, 1))
        correct.append(r.correct)
        if r.hit is not None:
            keep = r.hit if keep is None else keep & r.hit
    return total, losses, accs, correct


def simulated_accept_length(correct: list[Tensor], valid: Tensor, loss_mask: Tensor, depth: int) -> tuple[int, int]:
    """(tokens, cycles) of a chain of ``depth`` draft steps walking each sequence's
    assistant span the way the engine does (jump by accepted + 1 after each cycle).
    On greedy samples this is the acceptance the engine will measure."""
    table = torch.stack(correct[:depth], -1).tolist()  # [B, T, depth]
    tokens = cycles = 0
    for b in range(len(table)):
        mask = (loss_mask[b] & valid[b]).tolist()
        first = next((p for p, m in enumerate(mask) if m), None)
        if first is None:
            continue
        end = first + next((n for n, m in enumerate(mask[first:]) if not m), len(mask) - first)
        i = first - 1  # the first cycle's root is the first response token (pair index = its position - 1)
        while True:
            a = 0
            while a < depth and table[b][i][a]:
                a += 1
            if i + 2 + a > end - 1:  # only cycles whose tokens all lie inside the response count
                break
            tokens += a + 1
            cycles += 1
            i += a + 1
    return tokens, cycles

