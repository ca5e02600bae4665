"""`specdecode train`: EAGLE-3 drafter training with the training-time test (TTT).

The target runs frozen inside the loop (online: no cached features). For each batch it
gives the fused aux hidden states and its next-token distribution restricted to the
draft vocabulary. The draft then unrolls ``ttt_steps`` steps: step 0 reads the target's
hidden states, step j>0 its own step j-1 output, with tokens shifted by j, exactly as at
inference. At step j, index i is the drafted node of depth j+1 whose real prefix ends at
i, so its query sees step-0 keys up to i (causal) plus its own chain (steps 1..j at i),
at RoPE position i + j. Loss: soft cross-entropy against the target's distribution,
weighted 0.8^j.

Checkpoints (safetensors + JSON, written atomically) resume exactly: the data order is
a function of (seed, epoch) and the checkpoint records the position in it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specdecode.training.data import DataSet, draft_vocab, token_counts
from specdecode.core.drafter import Eagle3Drafter, random_drafter
from specdecode.io.checkpoints import save_drafter
from specdecode.io.hf import load_hf_dir
from specdecode.io.loading import parse_dtype, resolve_model_dir
from specdecode.core.model import Transformer, apply_rope, rope_cos_sin
from specdecode.runtime.device import configure_threads


@dataclass
class TrainConfig:
    data: str
    out: str
    model: str | None = None
    draft_vocab_size: int = 4096
    ttt_steps: int = 7
    step_weight: float = 0.8
    max_len: int = 768
    batch_tokens: int = 4096
    epochs: float = 2.0
    max_steps: int | None = None
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    limit_samples: int | None = None
    eval_every: int = 200
    save_every: int = 50
    eval_samples: int = 64
    target_dtype: str = "bfloat16"
    autocast: bool = True
    init_from_target: bool = True  # start the draft layer from the target's last layer
    fc_lr_scale: float = 0.1  # fc multiplies the target's massive activations (|x| ~ 1e4 on the first token)


# ---------------------------------------------------------------- batches

def make_batches(rows: list[dict], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """Deterministic batches for an epoch: shuffle (seed, epoch), then bucket neighbours by
    length so that padded size stays under ``batch_tokens``."""
    order = list(range(len(rows)))
    random.Random(cfg.seed * 1000 + epoch).shuffle(order)
    batches, chunk = [], 256  # sort within chunks of 256: less padding, still shuffled
    for s in range(0, len(order), chunk):
        part = sorted(order[s:s + chunk], key=lambda i: rows[i]["length"])
        cur: list[int] = []
        for i in part:
            width = min(max([rows[j]["length"] for j in cur + [i]]), cfg.max_len)
            if cur and width * (len(cur) + 1) > cfg.batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    random.Random(cfg.seed * 1000 + epoch + 1).shuffle(batches)
    return batches


def collate(ds: DataSet, rows: list[dict], idx: list[int], max_len: int, tokens_mm) -> tuple[Tensor, Tensor, Tensor]:
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
    return tokens, valid, loss


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
    out = target(tokens, torch.arange(T), target.new_cache(B, T), hidden_layers=(*aux, n),
                 logits_at=torch.zeros(0, dtype=torch.long))
    hidden = torch.cat(out.hidden_states[:-1], -1)
    where = needed.flatten().nonzero().squeeze(1)
    final = target.norm(out.hidden_states[-1].reshape(B * T, -1)[where])
    probs, best = [], []
    for s in range(0, len(where), chunk):
        logits = target.lm_head(final[s:s + chunk]).float()
        arg = logits.argmax(-1)
        best.append(torch.where(t2d[arg], target_to_draft[arg], -1))
        probs.append(torch.softmax(logits[:, t2d], -1).to(torch.bfloat16))  # halves the memory traffic
    row = torch.full((B * T,), -1, dtype=torch.long)
    row[where] = torch.arange(len(where))
    best_full = torch.full((B * T,), -1, dtype=torch.long)
    if len(where):
        best_full[where] = torch.cat(best)
    vd = int(t2d.sum())
    return TargetBatch(hidden, torch.cat(probs) if probs else torch.zeros(0, vd), row.view(B, T), best_full.view(B, T))


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
    """The draft's output hidden states [B, T, H] for each unrolled step (see module docstring)."""
    layer, c = drafter.midlayer, drafter.config.layer
    attn = layer.self_attn
    B, T = tokens.shape
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    scale = 1.0 / math.sqrt(hd)
    embed = drafter.embed_tokens
    idx = torch.arange(T)
    causal = (idx[None, :] <= idx[:, None])[None, None] & valid[:, None, None, :]  # [B,1,T,T]
    hidden = drafter.fc(tb.hidden.to(drafter.fc.weight.dtype))
    keys0 = values0 = None
    chain_k: list[Tensor] = []
    chain_v: list[Tensor] = []
    outputs = []
    for j in range(steps):
        x_emb = embed(shift_left(tokens, 1 + j)).detach().to(hidden.dtype)
        x = torch.cat((layer.input_layernorm(x_emb), layer.hidden_norm(hidden)), -1)
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
        h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(h)
        hidden = h
    return outputs


@dataclass
class StepResult:
    loss: Tensor  # mean soft cross-entropy over counted positions
    correct: Tensor  # [B, T] bool: draft argmax == target argmax at counted positions
    count: int


def step_result(drafter: Eagle3Drafter, h: Tensor, tb: TargetBatch, valid: Tensor, loss_mask: Tensor,
                j: int) -> StepResult:
    """Step j at index i predicts token i+2+j against the target's distribution at i+1+j;
    it counts when that token exists and is an assistant token. The lm_head runs only
    there; soft CE = logsumexp(z) - sum(p * z) (p sums to one)."""
    B, T = valid.shape
    ok = shift_left(loss_mask & valid, 2 + j, fill=False)
    b, i = ok.nonzero(as_tuple=True)
    logits = drafter.lm_head(drafter.norm(h[b, i])).float()
    rows = tb.row[b, i + 1 + j]
    p = tb.probs[rows].float()
    cross = torch.bmm(p.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # sum(p * z) without the product tensor
    loss = (torch.logsumexp(logits, -1) - cross).mean() if len(b) else logits.sum() * 0
    correct = torch.zeros(B, T, dtype=torch.bool)
    correct[b, i] = logits.argmax(-1) == tb.best[b, i + 1 + j]
    return StepResult(loss, correct, len(b))


def ttt_loss(drafter: Eagle3Drafter, outputs: list[Tensor], tb: TargetBatch, valid: Tensor, loss_mask: Tensor,
             weight: float) -> tuple[Tensor, list[float], list[float], list[Tensor]]:
    total = outputs[0].new_zeros((), dtype=torch.float32)
    losses, accs, correct = [], [], []
    for j, h in enumerate(outputs):
        r = step_result(drafter, h, tb, valid, loss_mask, j)
        total = total + weight ** j * r.loss
        losses.append(float(r.loss.detach()))
        accs.append(float(r.correct.sum()) / max(r.count, 1))
        correct.append(r.correct)
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


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(path: Path, drafter: Eagle3Drafter, opt: torch.optim.Optimizer, state: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "drafter.safetensors"))
    names = {id(p): n for n, p in drafter.named_parameters()}
    opt_tensors = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                opt_tensors[f"{names[id(p)]}::{k}"] = v.detach().clone().reshape(v.shape).contiguous()
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)


def load_checkpoint(path: Path, drafter: Eagle3Drafter, opt: torch.optim.Optimizer, cfg: TrainConfig) -> dict:
    from safetensors.torch import load_file

    for name in ("trainer_state.json", "drafter.safetensors", "optimizer.safetensors"):
        if not (path / name).exists():
            raise ValueError(f"{path}: checkpoint incomplete ({name} missing); delete it to start over")
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        weights = load_file(str(path / "drafter.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
    except Exception as e:  # corrupt JSON or safetensors
        raise ValueError(f"{path}: corrupt checkpoint ({type(e).__name__}: {e}); delete it to start over") from None
    saved_cfg = state.get("config", {})
    for key in ("draft_vocab_size", "ttt_steps", "data", "seed", "batch_tokens", "max_len", "limit_samples"):
        if key in saved_cfg and saved_cfg[key] != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint was made with {key}={saved_cfg[key]!r}, this run has "
                             f"{getattr(cfg, key)!r}; use the same settings or a new --out")
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: checkpoint weights do not fit this drafter: {e}") from None
    params = dict(drafter.named_parameters())
    for key, v in opt_tensors.items():
        name, _, slot = key.partition("::")
        opt.state[params[name]][slot] = v
    return state


# ---------------------------------------------------------------- the loop

def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_drafter(target: Transformer, d2t: Tensor, t2d: Tensor, cfg: TrainConfig) -> Eagle3Drafter:
    drafter = random_drafter(target, draft_vocab_size=len(d2t), seed=cfg.seed)
    # fp32 master weights (bf16 autocast does the matmuls); fp64 for fp64 exactness tests
    drafter = drafter.to(torch.float64 if target.dtype == torch.float64 else torch.float32)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if cfg.init_from_target:
            # A warm start that trains faster than noise: the target's last layer and its
            # lm_head rows for the draft vocabulary (norms at their trained values).
            last = target.layers[-1]
            m = drafter.midlayer
            h = target.config.hidden_size
            # fc starts as "take the deepest tap" (identity on it): the hidden state the
            # copied layer is used to, instead of a random projection of 3H inputs
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -h:] = torch.eye(h)
            m.self_attn.qkv_proj.weight[:, h:] = last.self_attn.qkv_proj.weight.float()
            m.self_attn.qkv_proj.weight[:, :h] = 0.0
            m.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight.float())
            m.mlp.gate_up_proj.weight.copy_(last.mlp.gate_up_proj.weight.float())
            m.mlp.down_proj.weight.copy_(last.mlp.down_proj.weight.float())
            m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
            m.hidden_norm.weight.copy_(last.input_layernorm.weight.float())
            drafter.norm.weight.copy_(target.norm.weight.float())
            drafter.lm_head.weight.copy_(target.lm_head.weight[t2d].float())
    drafter.requires_grad_(True)
    drafter.d2t.requires_grad_(False)
    return drafter.train()


@dataclass
class EvalResult:
    step_acc: list[float] = field(default_factory=list)
    step_loss: list[float] = field(default_factory=list)
    accept_length: float = float("nan")  # simulated chain of ttt_steps on greedy held-out samples
    accept_length_by_depth: dict = field(default_factory=dict)


@torch.no_grad()
def evaluate(drafter, target, ds, rows, cfg, aux, t2d, t2d_index, tokens_mm) -> EvalResult:
    drafter.eval()
    greedy = [i for i, r in enumerate(rows) if r.get("mode", "greedy") == "greedy"][:cfg.eval_samples]
    losses, accs, weights = np.zeros(cfg.ttt_steps), np.zeros(cfg.ttt_steps), 0
    sim = {d: [0, 0] for d in range(1, cfg.ttt_steps + 1)}
    for s in range(0, len(greedy), 8):
        idx = greedy[s:s + 8]
        tokens, valid, loss_mask = collate(ds, rows, idx, cfg.max_len, tokens_mm)
        tb = target_batch(target, tokens, needed_positions(valid, loss_mask), aux, t2d, t2d_index)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            outs = ttt_forward(drafter, tokens, valid, tb, cfg.ttt_steps)
            _, l, a, correct = ttt_loss(drafter, outs, tb, valid, loss_mask, cfg.step_weight)
        losses += np.array(l) * len(idx)
        accs += np.array(a) * len(idx)
        weights += len(idx)
        for d in sim:
            t, c = simulated_accept_length(correct, valid, loss_mask, d)
            sim[d][0] += t
            sim[d][1] += c
    drafter.train()
    by_depth = {d: t / c for d, (t, c) in sim.items() if c}
    return EvalResult(list(accs / max(weights, 1)), list(losses / max(weights, 1)),
                      by_depth.get(cfg.ttt_steps, float("nan")), by_depth)


def train(cfg: TrainConfig, console=None) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = console or Console(stderr=True)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    ds = DataSet(cfg.data)
    rows = ds.samples("train")
    heldout = ds.samples("heldout")
    if cfg.limit_samples:
        rows = rows[:cfg.limit_samples]
    if not rows:
        raise ValueError(f"{cfg.data}: no training samples")
    tokens_mm = ds.tokens()
    _, model_dir = resolve_model_dir(cfg.model)
    target = load_hf_dir(model_dir, parse_dtype(cfg.target_dtype), "cpu")
    aux = target.config.eagle3_aux_layer_ids

    counts = token_counts(ds, target.config.vocab_size)
    if cfg.limit_samples:  # the vocab from the samples actually used
        counts = np.zeros(target.config.vocab_size, dtype=np.int64)
        for r in rows:
            ids, mask = ds.read(r, tokens_mm)
            counts += np.bincount(np.asarray(ids)[np.asarray(mask)], minlength=len(counts))
    d2t, t2d, coverage = draft_vocab(counts, min(cfg.draft_vocab_size, target.config.vocab_size))
    t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(int(t2d.sum()))
    drafter = build_drafter(target, d2t, t2d, cfg)
    params = [p for p in drafter.parameters() if p.requires_grad]
    fc_params = [drafter.fc.weight]
    rest = [p for p in params if p is not drafter.fc.weight]
    opt = torch.optim.AdamW([{"params": rest, "lr_scale": 1.0}, {"params": fc_params, "lr_scale": cfg.fc_lr_scale}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    per_epoch = len(make_batches(rows, cfg, 0))
    total = cfg.max_steps or max(1, int(cfg.epochs * per_epoch))
    ckpt = out / "checkpoint"
    state = {"step": 0, "epoch": 0, "batch": 0, "log": [], "evals": []}
    if ckpt.exists():
        state = load_checkpoint(ckpt, drafter, opt, cfg)
        console.print(f"resumed from {ckpt} at step {state['step']}")
    state["config"] = asdict(cfg)
    state["draft_vocab_coverage"] = coverage
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"{len(rows)} training samples, {len(heldout)} held out; draft vocab {len(d2t)} covers "
                  f"{100 * coverage:.1f}% of assistant tokens; {total} steps ({per_epoch}/epoch)")

    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[info]}"))
    t_start = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=total, completed=state["step"], info="")
        while state["step"] < total:
            batches = make_batches(rows, cfg, state["epoch"])
            while state["batch"] < len(batches) and state["step"] < total:
                tokens, valid, loss_mask = collate(ds, rows, batches[state["batch"]], cfg.max_len, tokens_mm)
                tb = target_batch(target, tokens, needed_positions(valid, loss_mask), aux, t2d, t2d_index)
                for g in opt.param_groups:
                    g["lr"] = lr_at(state["step"], total, cfg) * g["lr_scale"]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
                    outs = ttt_forward(drafter, tokens, valid, tb, cfg.ttt_steps)
                    loss, losses, accs, _ = ttt_loss(drafter, outs, tb, valid, loss_mask, cfg.step_weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
                opt.step()
                state["step"] += 1
                state["batch"] += 1
                state["log"].append({"step": state["step"], "loss": float(loss.detach()), "acc": accs, "lr": opt.param_groups[0]["lr"],
                                     "grad_norm": grad_norm, "tokens": int(valid.sum())})
                progress.update(task, advance=1, info=f"loss {float(loss.detach()):.3f} acc " + " ".join(f"{a:.2f}" for a in accs))
                if heldout and (state["step"] % cfg.eval_every == 0 or state["step"] == total):
                    ev = evaluate(drafter, target, ds, heldout, cfg, aux, t2d, t2d_index, tokens_mm)
                    state["evals"].append({"step": state["step"], **asdict(ev)})
                    progress.console.print(f"step {state['step']}: held-out accept length (chain of "
                                           f"{cfg.ttt_steps}) {ev.accept_length:.2f}; step acc "
                                           + " ".join(f"{a:.2f}" for a in ev.step_acc))
                if state["step"] % cfg.save_every == 0 or state["step"] == total:
                    save_checkpoint(ckpt, drafter, opt, state)
            if state["batch"] >= len(batches):
                state["epoch"] += 1
                state["batch"] = 0
    save_drafter(drafter, out, dtype=torch.bfloat16, extra_config={
        "specdecode_training": {"steps": state["step"], "samples": len(rows), "draft_vocab_coverage": coverage,
                                "data": str(cfg.data)}})
    summary = {"steps": state["step"], "samples": len(rows), "coverage": coverage,
               "assistant_tokens": int(sum(b - a for r in rows for a, b in r["loss_ranges"])),
               "seconds_this_run": time.perf_counter() - t_start,
               "final_eval": state["evals"][-1] if state["evals"] else None}
    (out / "training_summary.json").write_text(json.dumps(summary | {"config": asdict(cfg)}, indent=1))
    with open(out / "training_log.jsonl", "w") as f:
        for rec in state["log"]:
            f.write(json.dumps(rec) + "\n")
    return summary


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig(data="", out="")
    p.add_argument("--data", required=True, help="data directory from `specdecode data build`")
    p.add_argument("--out", required=True, help="output drafter directory (checkpoint inside; resumes if present)")
    p.add_argument("--model", default=None, help="target model (default: the SmolLM2 GGUF)")
    for name in ("draft_vocab_size", "ttt_steps", "max_len", "batch_tokens", "max_steps", "seed", "limit_samples",
                 "eval_every", "save_every", "eval_samples"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("epochs", "lr", "warmup_ratio", "weight_decay", "grad_clip", "step_weight", "min_lr_ratio",
                 "fc_lr_scale"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--target-dtype", default=d.target_dtype, help="dtype of the frozen target (bfloat16 | float32)")
    p.add_argument("--no-autocast", action="store_true", help="train the draft in fp32 (slower)")
    p.add_argument("--random-init", action="store_true", help="do not warm-start from the target's last layer")
    p.add_argument("--threads", type=int, default=None)


def cmd_train(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    fields = {k: getattr(args, k) for k in TrainConfig.__dataclass_fields__ if hasattr(args, k)}
    cfg = TrainConfig(**fields | {"autocast": not args.no_autocast, "init_from_target": not args.random_init})
    summary = train(cfg)
    print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------- trainer vs engine

def eval_drafter(data: str, drafter_path: str, model: str | None, depth: int, samples: int, dtype: str,
                 max_len: int = 768) -> dict:
    """Held-out acceptance two ways on the same greedy samples: simulated from the
    training-time test (what the trainer reports) and measured by the engine (chain of
    ``depth``). They must agree; a gap means wiring or mask bugs."""
    from specdecode.io.checkpoints import load_drafter
    from specdecode.core.engine import Engine, GenerateOptions
    from specdecode.io.loading import load_model
    from specdecode.core.speculative import Eagle3Decoder, SpecConfig

    ds = DataSet(data)
    rows = [r for r in ds.samples("heldout") if r.get("mode", "greedy") == "greedy"][:samples]
    if not rows:
        raise ValueError(f"{data}: no greedy held-out samples to evaluate on")
    tokens_mm = ds.tokens()
    loaded = load_model(model, dtype, "cpu")
    target = loaded.model
    drafter = load_drafter(drafter_path, target)
    t2d = drafter.t2d.cpu()
    t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[t2d] = torch.arange(int(t2d.sum()))
    aux = drafter.config.aux_layer_ids
    sim_tokens = sim_cycles = 0
    engine = Engine(target, loaded.tokenizer, Eagle3Decoder(drafter, SpecConfig(depth, 1)))
    eng_tokens = eng_cycles = 0
    same_text = 0
    for r in rows:
        tokens, valid, loss_mask = collate(ds, [r], [0], max_len, tokens_mm)
        with torch.no_grad():
            tb = target_batch(target, tokens, needed_positions(valid, loss_mask), aux, t2d, t2d_index)
            outs = ttt_forward(drafter, tokens, valid, tb, depth)
            correct = [step_result(drafter, h, tb, valid, loss_mask, j).correct for j, h in enumerate(outs)]
        t, c = simulated_accept_length(correct, valid, loss_mask, depth)
        sim_tokens, sim_cycles = sim_tokens + t, sim_cycles + c
        start, end = r["loss_ranges"][0]
        prompt = tokens[0, :start].tolist()
        ref = tokens[0, start:min(end, tokens.shape[1])].tolist()
        result = engine.generate(prompt, GenerateOptions(max_new_tokens=len(ref)))
        same_text += result.token_ids == ref
        if result.stats:
            eng_tokens += result.stats["accept_length"] * result.stats["cycles"]
            eng_cycles += result.stats["cycles"]
    return {"samples": len(rows), "depth": depth, "dtype": dtype,
            "trainer_accept_length": sim_tokens / max(sim_cycles, 1),
            "engine_accept_length": eng_tokens / max(eng_cycles, 1),
            "engine_reproduced_response": f"{same_text}/{len(rows)}"}


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--depth", type=int, default=4, help="chain depth (num_steps)")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)


def cmd_eval(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    print(json.dumps(eval_drafter(args.data, args.drafter, args.model, args.depth, args.samples, args.dtype)))
    return 0
