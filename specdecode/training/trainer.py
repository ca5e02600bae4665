"""`specdecode train`: EAGLE-3 drafter training with the training-time test (TTT, see
``specdecode.training.ttt``), the target online inside the loop.

Checkpoints (``specdecode.training.checkpoint``) resume exactly: the data order is a
function of (seed, epoch) and the checkpoint records the position in it. Progress is
reported through ``on_progress`` (``TrainStarted``, ``StepDone``, ``EvalDone``).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from specdecode.core.drafter import VARIANT_FLAGS, Eagle3Drafter, random_drafter, with_variant
from specdecode.core.model import DecoderLayer, RMSNorm, Transformer
from specdecode.io.checkpoints import load_drafter, save_drafter
from specdecode.io.hf import load_hf_dir
from specdecode.io.loading import parse_dtype, resolve_model_dir
from specdecode.io.paths import model_name, prepare_output
from specdecode.runtime.autoformat import fast_bf16
from specdecode.runtime.device import resolve_device
from specdecode.training.checkpoint import load_checkpoint, save_checkpoint
from specdecode.training.dataset import (
    DataSet,
    assistant_tokens,
    draft_index,
    draft_vocab,
    sample_token_counts,
    token_counts,
    trains_inside,
)
from specdecode.training.evaluate import EvalResult, EvalSettings, evaluate
from specdecode.training.features import FeatureProgress, build_features, cached_target_batch
from specdecode.training.ttt import collate, needed_positions, target_batch, ttt_forward, ttt_loss

SELECT_MODES = ("best", "last")


@dataclass
class TrainConfig:
    data: str
    out: str
    model: str | None = None
    # The defaults are the recipe that trained the shipped drafter from scratch (its v3; docs/training.md)
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    step_weight: float = 0.8
    max_len: int = 768
    batch_tokens: int = 2048
    epochs: float = 8.0
    max_steps: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    limit_samples: int | None = None
    # the first N training samples left out (before limit_samples), e.g. those the --init-from drafter was trained
    # on when its data set has grown since: a continued run then spends its steps on answers it has not seen
    skip_samples: int = 0
    eval_every: int = 200
    save_every: int = 50
    eval_samples: int = 64
    # more data sets evaluated at every evaluation, reported beside --data's figure (the best checkpoint is still
    # chosen on --data's): the held-out answers of the training distribution overstate acceptance on other
    # prompts (datasets/smollm2-135m-unseen-v1: prompts from outside the training corpus)
    eval_data: tuple[str, ...] = ()
    # "auto" and None (autocast): bf16 where the device computes it natively (runtime.autoformat's rule),
    # else fp32. Measured per 2048-token batch of the v4 data (2 threads, online target, TTT depth 3):
    # on an AVX2-only EPYC (Zen 3) the bf16 target took 30.4 s against 5.1 s in fp32, and the draft's
    # step 61.7 s under bf16 autocast against 2.5 s in fp32; on the Zen 4 EPYC (avx512_bf16) bf16 is
    # the fast one (0.92 s target, 0.46 s draft, v3's run).
    target_dtype: str = "auto"
    autocast: bool | None = None
    init_from_target: bool = True  # start the draft layer from the target's last layer
    # Start from a trained drafter instead (its weights and draft vocabulary): more data for a shipped
    # drafter without repeating its steps. The optimizer and the schedule start afresh.
    init_from: str | None = None
    fc_lr_scale: float = 0.1  # fc multiplies the target's massive activations (|x| ~ 1e4 on the first token)
    device: str = "cpu"  # cpu | cuda | cuda:N | auto: where the target and the drafter run
    feature_cache: str | None = None  # a directory: the target's features computed once, read every epoch
    feature_noise: float = 0.0  # gaussian noise on each target tap, std relative to that tap's RMS per position
    # GRIFFIN's token-alignable loss (ttt.ttt_loss): step j > 0 trains only where the earlier steps put the
    # target's token in their top-k (k = 2: the default tree's width); 0 trains every position (EAGLE-3)
    align_topk: int = 0
    # DSpark's acceptance loss: each step's loss is (1 - tv_weight) x soft CE + tv_weight x the total variation
    # between the target's and the draft's distributions (DSpark: 0.9); 0 is EAGLE-3's CE alone
    tv_weight: float = 0.0
    # the head's variant flags (core.drafter.VARIANT_FLAGS: fc_norm and norm_output are EAGLE-3.1's); a variant
    # drafter is written in vLLM's speculators layout
    variant: tuple[str, ...] = ()
    # Which weights the run writes: "best", the held-out evaluation with the highest simulated accept
    # length (chain of ttt_steps; SpecForge keeps a checkpoint per evaluation and picks by acceptance
    # too), or "last". v3's held-out curve was flat after epoch 5 of 8 while training accuracy rose.
    select: str = "best"
    # An --out that holds something other than this run's checkpoint is refused unless overwrite (it is then
    # emptied first): a new drafter never lands beside another's acceptance table or model card.
    overwrite: bool = False
    # Epochs chosen by the held-out curve: stop once this many evaluations in a row have not beaten
    # the best by min_delta (0: run every epoch). ``epochs`` is then the most the schedule allows.
    patience: int = 0
    min_delta: float = 0.01  # accept length; 96 held-out answers measure it to about +-0.01

    def __post_init__(self) -> None:
        if self.select not in SELECT_MODES:
            raise ValueError(f"select={self.select!r}: use one of {', '.join(SELECT_MODES)}")
        unknown = [v for v in self.variant if v not in VARIANT_FLAGS]
        if unknown:
            raise ValueError(f"variant {unknown}: use flags among {', '.join(VARIANT_FLAGS)} (--variant)")
        if self.align_topk < 0:
            raise ValueError(f"align_topk={self.align_topk}: give 0 (train every position) or the draft's top-k")
        if self.patience < 0:
            raise ValueError(f"patience={self.patience}: give 0 (run every epoch) or a number of evaluations")
        if self.skip_samples < 0 or (self.limit_samples or 0) < 0:
            raise ValueError(f"skip_samples={self.skip_samples}, limit_samples={self.limit_samples}: give numbers of "
                             f"samples >= 0")
        at_least_one = ("draft_vocab_size", "ttt_steps", "batch_tokens", "eval_every", "save_every", "eval_samples")
        positive = ("epochs", "grad_clip", "step_weight")  # lr 0 is allowed: a run that only evaluates
        for name in at_least_one + positive + ("max_steps",):
            value = getattr(self, name)
            if value is not None and (value < 1 if name in at_least_one or name == "max_steps" else value <= 0):
                raise ValueError(f"{name}={value}: it must be {'at least 1' if name not in positive else 'above 0'} "
                                 f"(--{name.replace('_', '-')})")
        if self.max_len < 2:
            raise ValueError(f"max_len={self.max_len}: a sample needs at least 2 tokens (--max-len)")
        shares = ("warmup_ratio", "min_lr_ratio", "tv_weight")
        for name in ("lr", "weight_decay", "feature_noise", *shares):
            value = getattr(self, name)
            if value < 0 or (name in shares and value > 1):
                raise ValueError(f"{name}={value}: it must be >= 0{' and <= 1' if name in shares else ''} "
                                 f"(--{name.replace('_', '-')})")

    @property
    def eval_settings(self) -> EvalSettings:
        return EvalSettings(self.eval_samples, self.ttt_steps, self.max_len, bool(self.autocast), self.step_weight)


# ---------------------------------------------------------------- batches

def make_batches(rows: list[dict[str, Any]], cfg: TrainConfig, epoch: int) -> list[list[int]]:
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


# ---------------------------------------------------------------- progress

@dataclass(frozen=True)
class TrainStarted:
    """Once, before the first step: the run's size, and where it resumes (``resumed_from``)."""

    samples: int
    heldout: int
    draft_vocab_size: int
    coverage: float  # share of assistant tokens inside the draft vocabulary
    total_steps: int
    steps_per_epoch: int
    step: int  # the first step of this run (> 0 when resumed)
    resumed_from: str | None = None  # the checkpoint directory, when resumed
    precision: str = ""  # the target's dtype and the draft's autocast, and why (resolve_precision)
    skipped: int = 0  # training samples with no answer token inside max_len (dataset.trains_inside)


@dataclass(frozen=True)
class StepDone:
    """After each optimizer step: its log record (``step``, ``loss``, ``acc`` per TTT step, ``lr``...)."""

    step: int
    total_steps: int
    record: dict[str, Any]


@dataclass(frozen=True)
class EvalDone:
    """After each held-out evaluation: its result, the best so far, and whether the run stops here
    (``patience`` evaluations without a gain)."""

    step: int
    result: EvalResult
    best_step: int | None = None
    best_accept_length: float = float("nan")
    stopping: bool = False
    others: dict[str, float] = field(default_factory=dict)  # accept length on each --eval-data set, by its name


TrainEvent = TrainStarted | StepDone | EvalDone | FeatureProgress
OnTrainProgress = Callable[[TrainEvent], None]


# ---------------------------------------------------------------- the loop

def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def add_feature_noise(hidden: Tensor, taps: int, scale: float, seed: int) -> Tensor:
    """EAGLE-1's feature noise, made scale-free: each of the ``taps`` fused hidden states gets
    gaussian noise of std ``scale`` x its own RMS at that position (SmolLM2's first-token
    activations are ~1e4, the rest ~1-10, so one absolute std fits neither). Seeded per step:
    a resumed run draws the same noise."""
    B, T, W = hidden.shape
    x = hidden.float().view(B, T, taps, W // taps)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=g).to(x.device) * rms * scale
    return (x + noise).view(B, T, W).to(hidden.dtype)


def build_drafter(target: Transformer, d2t: Tensor, t2d: Tensor, cfg: TrainConfig) -> Eagle3Drafter:
    drafter = random_drafter(target, draft_vocab_size=len(d2t), seed=cfg.seed, variant=cfg.variant)
    # fp32 master weights (bf16 autocast does the matmuls); fp64 for fp64 exactness tests
    drafter = drafter.to(torch.float64 if target.dtype == torch.float64 else torch.float32).to(target.device)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if cfg.init_from_target:
            # A warm start that trains faster than noise: the target's last layer and its
            # lm_head rows for the draft vocabulary (norms at their trained values).
            last = cast(DecoderLayer, target.layers[-1])
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


def resolve_precision(cfg: TrainConfig, device: torch.device) -> tuple[TrainConfig, str]:
    """``cfg`` with ``target_dtype="auto"`` and ``autocast=None`` decided for ``device``, and why."""
    ok, why = fast_bf16(device)
    target_dtype = cfg.target_dtype if cfg.target_dtype != "auto" else ("bfloat16" if ok else "float32")
    autocast = cfg.autocast if cfg.autocast is not None else ok
    parse_dtype(target_dtype)  # an unknown name fails here, with the choices
    asked = cfg.target_dtype != "auto" and cfg.autocast is not None
    reason = f"target {target_dtype}, draft {'bf16 autocast' if autocast else 'fp32'}" + ("" if asked else f": {why}")
    return replace(cfg, target_dtype=target_dtype, autocast=autocast), reason


def warm_drafter(path: str, target: Transformer, cfg: TrainConfig) -> Eagle3Drafter:
    """A trained drafter (``--init-from``) as the starting point, fp32 master weights; refused,
    with the fix, where it cannot continue this run (another draft vocabulary size or other taps)."""
    drafter = load_drafter(path, target, dtype=torch.float64 if target.dtype == torch.float64 else torch.float32)
    if drafter.config.draft_vocab_size != cfg.draft_vocab_size:
        raise ValueError(f"--init-from {path}: its draft vocabulary has {drafter.config.draft_vocab_size} tokens, "
                         f"this run asks {cfg.draft_vocab_size}; pass --draft-vocab-size "
                         f"{drafter.config.draft_vocab_size}")
    taps = tuple(drafter.config.aux_layer_ids)
    if taps != tuple(target.config.eagle3_aux_layer_ids):
        raise ValueError(f"--init-from {path}: it reads the target's layers {list(taps)}, the trainer feeds "
                         f"{list(target.config.eagle3_aux_layer_ids)}; train from scratch (drop --init-from)")
    if drafter.config.variant != tuple(cfg.variant):
        if drafter.config.variant:
            raise ValueError(f"--init-from {path}: a {'+'.join(drafter.config.variant)} variant; this run asks "
                             f"{'+'.join(cfg.variant) or 'none'}: pass --variant {','.join(drafter.config.variant)}")
        plain, drafter = drafter, Eagle3Drafter(with_variant(drafter.config, cfg.variant), target.embed_tokens)
        drafter = drafter.to(device=plain.device, dtype=plain.dtype)
        missing, _ = drafter.load_state_dict(plain.state_dict(), strict=False)  # the variant's norms: ones
        if any(not k.startswith(("fc_norm.", "input_norm.")) for k in missing):
            raise ValueError(f"--init-from {path}: cannot start the variant from it (missing {missing})")
    drafter.requires_grad_(True)
    drafter.d2t.requires_grad_(False)
    return drafter.train()


@torch.no_grad()
def scale_new_norms(drafter: Eagle3Drafter, taps: Tensor) -> None:
    """Set a variant's input norms (fc_norm, input_norm) to the median RMS of what they normalize in
    ``taps`` [B, T, n_aux*H_t]: fc then sees the taps at their usual scale, as the drafter it starts from
    did, except at the few positions with massive activations, which the norms exist to tame."""
    x = taps.float().reshape(-1, taps.shape[-1])
    if drafter.input_norm is not None:
        drafter.input_norm.weight.fill_(float(x.pow(2).mean(-1).sqrt().median()))
    if drafter.fc_norm is not None:
        for norm, part in zip(drafter.fc_norm, x.chunk(len(drafter.fc_norm), -1), strict=True):
            cast(RMSNorm, norm).weight.fill_(float(part.pow(2).mean(-1).sqrt().median()))


def _optimizer(drafter: Eagle3Drafter, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW over the trainable parameters, ``fc`` at ``fc_lr_scale`` times the rate."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    fc_params = [drafter.fc.weight]
    rest = [p for p in params if p is not drafter.fc.weight]
    opt = torch.optim.AdamW([{"params": rest, "lr_scale": 1.0}, {"params": fc_params, "lr_scale": cfg.fc_lr_scale}],
                            lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    return opt, params


def _track_best(state: dict[str, Any], accept_length: float, cfg: TrainConfig, save_best: Callable[[], None]) -> None:
    """After an evaluation: keep the best (``state["best"]``, its weights via ``save_best``), count
    evaluations without a gain of ``min_delta`` (``state["stale"]``) and stop at ``patience`` of them."""
    best = state.get("best")
    if math.isnan(accept_length):
        return
    if best is None or accept_length >= best["accept_length"] + cfg.min_delta:
        state["stale"] = 0
    else:
        state["stale"] = state.get("stale", 0) + 1
    if best is None or accept_length > best["accept_length"]:
        state["best"] = {"step": state["step"], "epoch": state["epoch"], "accept_length": accept_length}
        save_best()
    if cfg.patience and state["stale"] >= cfg.patience:
        state["stopped_early"] = state["step"]


def _save_output(drafter: Eagle3Drafter, path: Path, state: dict[str, Any], rows: list[dict[str, Any]],
                 coverage: float, cfg: TrainConfig) -> None:
    """The drafter in the SGLang/vLLM/SpecForge format (bf16) into ``path``, written beside it first:
    a kill leaves whole files (other files there, the run's checkpoint and logs, stay)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp, dtype=torch.bfloat16, extra_config={
        "specdecode_training": {"steps": state["step"], "samples": len(rows), "draft_vocab_coverage": coverage,
                                "data": str(cfg.data)}}, verifier=model_name(cfg.model))
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (tmp / name).replace(path / name)
    shutil.rmtree(tmp)


class _StepLog:
    """``training_log.jsonl``, one line per step as it is trained (a run still going can be read). It starts
    from the checkpoint's log: steps trained after the last checkpoint of a killed run are trained again."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.file = open(path, "w")  # noqa: SIM115 (closed by close(); open for the whole run)
        for rec in records:
            self.append(rec)

    def append(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(cfg: TrainConfig, on_progress: OnTrainProgress | None = None) -> dict[str, Any]:
    """Train (or resume) a drafter into ``cfg.out``; returns the run's summary (also written to
    ``training_summary.json``, with the per-step log in ``training_log.jsonl``)."""
    report = on_progress or (lambda _: None)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    prepare_output(out, "--out", cfg.overwrite, resumable="checkpoint")
    ds = DataSet(cfg.data)
    rows = ds.samples("train")
    heldout = ds.samples("heldout")
    eval_sets = {}
    for path in cfg.eval_data:  # reported by directory name
        other = DataSet(path)
        name = other.root.resolve().name
        if name in eval_sets:
            raise ValueError(f"--eval-data {path}: another set is also named {name!r}; give each a directory of "
                             f"its own name")
        eval_sets[name] = (other, other.samples("heldout"), other.tokens())
        if not eval_sets[name][1]:
            raise ValueError(f"--eval-data {path}: no held-out samples to evaluate on")
    if cfg.skip_samples:
        if cfg.skip_samples >= len(rows):
            raise ValueError(f"--skip-samples {cfg.skip_samples}: {cfg.data} has only {len(rows)} training samples; "
                             f"skip fewer")
        rows = rows[cfg.skip_samples:]
    if cfg.limit_samples:
        rows = rows[:cfg.limit_samples]
    if not rows:
        raise ValueError(f"{cfg.data}: no training samples")
    if cfg.select == "best" and not heldout:
        raise ValueError(f"{cfg.data}: no held-out samples, so --select best has no evaluation to choose the "
                         f"weights by; build the data set with some (data build --heldout-percent) or pass "
                         f"--select last")
    n_all = len(rows)
    rows = [r for r in rows if trains_inside(r, cfg.max_len)]
    if not rows:
        raise ValueError(f"{cfg.data}: no training sample has an answer token inside --max-len {cfg.max_len}; "
                         f"raise --max-len")
    tokens_mm = ds.tokens()
    _, model_dir = resolve_model_dir(cfg.model)
    device = resolve_device(cfg.device)
    cfg, precision = resolve_precision(cfg, device)
    target = load_hf_dir(model_dir, parse_dtype(cfg.target_dtype), str(device))
    aux = target.config.eagle3_aux_layer_ids
    vocab = target.config.vocab_size

    # with limit_samples or skip_samples, the vocab from the samples actually used
    subset = bool(cfg.limit_samples or cfg.skip_samples)
    counts = sample_token_counts(ds, rows, vocab, tokens_mm) if subset else token_counts(ds, vocab)
    if cfg.init_from:
        drafter = warm_drafter(cfg.init_from, target, cfg)
        d2t, t2d = drafter.d2t.cpu(), drafter.t2d.cpu()
        coverage = float(counts[t2d.numpy()].sum() / max(counts.sum(), 1))
    else:
        d2t, t2d, coverage = draft_vocab(counts, min(cfg.draft_vocab_size, vocab))
        drafter = build_drafter(target, d2t, t2d, cfg)
    t2d, t2d_index = t2d.to(device), draft_index(t2d).to(device)
    opt, params = _optimizer(drafter, cfg)
    if cfg.feature_cache:
        store = build_features(cfg.feature_cache, ds, target, aux, cfg.max_len, str(model_dir), on_progress=report)
        arrays = store.arrays()
        draft_head = target.lm_head.weight.detach()[t2d]

    per_epoch = len(make_batches(rows, cfg, 0))
    total = cfg.max_steps or max(1, int(cfg.epochs * per_epoch))
    ckpt = out / "checkpoint"
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch": 0, "log": [], "evals": []}
    resumed = ckpt.exists()
    if resumed:
        state = load_checkpoint(ckpt, drafter, opt, asdict(cfg))
        # the batches index the samples trained on: another set (a data set grown in place, another
        # rule for what trains) would resume at the same index of another order
        if state.get("trained_samples", len(rows)) != len(rows):
            raise ValueError(f"{ckpt}: the checkpoint trained on {state['trained_samples']} samples, this run has "
                             f"{len(rows)} (the data set or the samples kept changed); use a new --out")
    state["trained_samples"] = len(rows)
    state["config"] = asdict(cfg)
    state["draft_vocab_coverage"] = coverage
    out.mkdir(parents=True, exist_ok=True)
    step_log = _StepLog(out / "training_log.jsonl", state["log"])
    report(TrainStarted(len(rows), len(heldout), len(d2t), coverage, total, per_epoch, state["step"],
                        str(ckpt) if resumed else None, precision, n_all - len(rows)))

    def evaluate_now() -> None:
        ev = evaluate(drafter, target, ds, heldout, cfg.eval_settings, aux, t2d, t2d_index, tokens_mm)
        others = {name: evaluate(drafter, target, other, rows_, cfg.eval_settings, aux, t2d, t2d_index, tok_)
                  for name, (other, rows_, tok_) in eval_sets.items()}
        state["evals"].append({"step": state["step"], **asdict(ev),
                               **({"others": {k: asdict(v) for k, v in others.items()}} if others else {})})
        _track_best(state, ev.accept_length, cfg, lambda: _save_output(drafter, out / "best", state, rows,
                                                                        coverage, cfg))
        best = state.get("best") or {}
        report(EvalDone(state["step"], ev, best.get("step"), best.get("accept_length", float("nan")),
                        bool(state.get("stopped_early")), {k: v.accept_length for k, v in others.items()}))

    t_start = time.perf_counter()
    if cfg.variant and not resumed:  # the variant's new input norms, from the first batch's taps
        tokens, valid, loss_mask = collate(ds, rows, make_batches(rows, cfg, 0)[0], cfg.max_len, tokens_mm, device)
        scale_new_norms(drafter, target_batch(target, tokens, needed_positions(valid, loss_mask), aux, t2d,
                                              t2d_index).hidden)
    if cfg.init_from and heldout and not state["evals"]:
        # the starting drafter is the first candidate: a continued run never ships worse than it
        # began, and its curve starts from the starting point's own held-out figure
        evaluate_now()
    while state["step"] < total and not state.get("stopped_early"):
        batches = make_batches(rows, cfg, state["epoch"])
        while state["batch"] < len(batches) and state["step"] < total and not state.get("stopped_early"):
            tokens, valid, loss_mask = collate(ds, rows, batches[state["batch"]], cfg.max_len, tokens_mm, device)
            needed = needed_positions(valid, loss_mask)
            if cfg.feature_cache:
                tb = cached_target_batch(store, arrays, rows, batches[state["batch"]], needed, draft_head, t2d,
                                         t2d_index)
            else:
                tb = target_batch(target, tokens, needed, aux, t2d, t2d_index)
            if cfg.feature_noise:
                seed = cfg.seed * 1_000_003 + state["step"]
                tb.hidden = add_feature_noise(tb.hidden, len(aux), cfg.feature_noise, seed)
            for g in opt.param_groups:
                g["lr"] = lr_at(state["step"], total, cfg) * g["lr_scale"]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(cfg.autocast)):
                outs = ttt_forward(drafter, tokens, valid, tb, cfg.ttt_steps)
                loss, losses, accs, _ = ttt_loss(drafter, outs, tb, valid, loss_mask, cfg.step_weight,
                                                 cfg.align_topk, cfg.tv_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            state["step"] += 1
            state["batch"] += 1
            record = {"step": state["step"], "loss": float(loss.detach()), "acc": accs,
                      "lr": opt.param_groups[0]["lr"], "grad_norm": grad_norm, "tokens": int(valid.sum())}
            state["log"].append(record)
            step_log.append(record)
            report(StepDone(state["step"], total, record))
            if heldout and (state["step"] % cfg.eval_every == 0 or state["step"] == total):
                evaluate_now()
            if state["step"] % cfg.save_every == 0 or state["step"] == total:
                save_checkpoint(ckpt, drafter, opt, state)
        if state["batch"] >= len(batches):
            state["epoch"] += 1
            state["batch"] = 0
    best = state.get("best")
    if cfg.select == "best" and best is not None and (out / "best" / "model.safetensors").exists():
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(out / "best" / name, out / name)
        selected = best["step"]
    else:
        _save_output(drafter, out, state, rows, coverage, cfg)
        selected = state["step"]
    summary = {"steps": state["step"], "samples": len(rows), "coverage": coverage,
               "assistant_tokens": assistant_tokens(rows), "skipped_samples": n_all - len(rows),
               "seconds_this_run": time.perf_counter() - t_start,
               "final_eval": state["evals"][-1] if state["evals"] else None,
               "best": best, "selected_step": selected, "stopped_early": bool(state.get("stopped_early"))}
    (out / "training_summary.json").write_text(json.dumps(summary | {"config": asdict(cfg)}, indent=1))
    step_log.close()
    return summary
