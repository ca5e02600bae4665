"""Held-out acceptance: estimated by the trainer from the training-time test (``evaluate``),
and checked against what the engine measures on the same samples (``eval_drafter``,
`specdecode eval-drafter`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdecode.core.costmodel import CANDIDATE_TOPK_STEPS
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.engine import Engine
from specdecode.core.model import Transformer
from specdecode.core.quant import detect_format
from specdecode.core.requests import GenerateOptions
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.checkpoints import load_drafter, write_acceptance
from specdecode.io.paths import file_fingerprint
from specdecode.runtime.decoders import load_session_drafter
from specdecode.runtime.session import Session
from specdecode.training.dataset import DataSet, draft_index
from specdecode.training.ttt import (
    collate,
    needed_positions,
    simulated_accept_length,
    step_result,
    target_batch,
    ttt_forward,
    ttt_loss,
)


@dataclass
class EvalResult:
    step_acc: list[float] = field(default_factory=list)
    step_loss: list[float] = field(default_factory=list)
    accept_length: float = float("nan")  # simulated chain of ttt_steps on greedy held-out samples
    accept_length_by_depth: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSettings:
    """What the held-out evaluation reads of a training run's settings (``TrainConfig.eval_settings``)."""

    eval_samples: int
    ttt_steps: int
    max_len: int
    autocast: bool
    step_weight: float


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, target: Transformer, ds: DataSet, rows: list[dict], cfg: EvalSettings,
             aux: tuple[int, ...], t2d: torch.Tensor, t2d_index: torch.Tensor, tokens_mm: np.ndarray) -> EvalResult:
    drafter.eval()
    greedy = [i for i, r in enumerate(rows) if r.get("mode", "greedy") == "greedy"][:cfg.eval_samples]
    losses, accs, weights = np.zeros(cfg.ttt_steps), np.zeros(cfg.ttt_steps), 0
    sim = {d: [0, 0] for d in range(1, cfg.ttt_steps + 1)}
    for s in range(0, len(greedy), 8):
        idx = greedy[s:s + 8]
        tokens, valid, loss_mask = collate(ds, rows, idx, cfg.max_len, tokens_mm, target.device)
        tb = target_batch(target, tokens, needed_positions(valid, loss_mask), aux, t2d, t2d_index)
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=cfg.autocast):
            outs = ttt_forward(drafter, tokens, valid, tb, cfg.ttt_steps)
            _, step_losses, step_accs, correct = ttt_loss(drafter, outs, tb, valid, loss_mask, cfg.step_weight)
        losses += np.array(step_losses) * len(idx)
        accs += np.array(step_accs) * len(idx)
        weights += len(idx)
        for d in sim:
            t, c = simulated_accept_length(correct, valid, loss_mask, d)
            sim[d][0] += t
            sim[d][1] += c
    drafter.train()
    by_depth = {d: t / c for d, (t, c) in sim.items() if c}
    return EvalResult(list(accs / max(weights, 1)), list(losses / max(weights, 1)),
                      by_depth.get(cfg.ttt_steps, float("nan")), by_depth)


# ---------------------------------------------------------------- trainer vs engine

@dataclass(frozen=True)
class EvalDrafterConfig:
    """`specdecode eval-drafter`: a trained drafter on a data set's greedy held-out samples."""

    data: str
    drafter: str
    depth: int = 4  # chain depth (num_steps)
    samples: int = 40
    max_len: int = 768
    drafter_weights: str = "auto"  # the engine's drafter format (runtime.decoders.load_session_drafter)


def greedy_heldout(ds: DataSet, max_len: int, samples: int, purpose: str) -> list[dict]:
    """The first ``samples`` greedy held-out samples with an answer inside ``max_len`` (an empty
    answer leaves the engine nothing to generate)."""
    rows = [r for r in ds.samples("heldout") if r.get("mode", "greedy") == "greedy"
            and min(r["loss_ranges"][0][1], max_len) > r["loss_ranges"][0][0]][:samples]
    if not rows:
        raise ValueError(f"{ds.root}: no greedy held-out samples to {purpose}")
    return rows


def eval_drafter(cfg: EvalDrafterConfig, session: Session) -> dict:
    """Held-out acceptance two ways on the same greedy samples: simulated from the
    training-time test (what the trainer reports) and measured by the engine (chain of
    ``depth``). They must agree; a gap means wiring or mask bugs."""

    ds = DataSet(cfg.data)
    rows = greedy_heldout(ds, cfg.max_len, cfg.samples, "evaluate on")
    tokens_mm = ds.tokens()
    target = session.loaded.model
    drafter = load_drafter(cfg.drafter, target)  # the trainer's estimate reads float weights
    engine_drafter = load_session_drafter(session, cfg.drafter, cfg.drafter_weights)
    t2d = drafter.t2d
    t2d_index = draft_index(t2d)
    aux = drafter.config.aux_layer_ids
    depth = cfg.depth
    sim_tokens = sim_cycles = 0
    engine = Engine(target, session.loaded.tokenizer, Eagle3Decoder(engine_drafter, SpecConfig(depth, 1)))
    eng_tokens = eng_cycles = 0
    same_text = 0
    for r in rows:
        tokens, valid, loss_mask = collate(ds, [r], [0], cfg.max_len, tokens_mm, target.device)
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
    return {"samples": len(rows), "depth": depth, "dtype": session.config.dtype,
            "drafter_format": detect_format(engine_drafter),
            "trainer_accept_length": sim_tokens / max(sim_cycles, 1),
            "engine_accept_length": eng_tokens / max(eng_cycles, 1),
            "engine_reproduced_response": f"{same_text}/{len(rows)}"}


# ---------------------------------------------------------------- acceptance table (--spec-config auto)

@dataclass(frozen=True)
class AcceptanceTableConfig:
    """`specdecode eval-drafter --acceptance-table`: per-position acceptance of the deepest
    candidate shape of each top-k, measured by the engine on greedy held-out samples of one or more
    data sets, each set an equal share (the mean of its per-position figures)."""

    data: tuple[str, ...]
    drafter: str
    samples: int = 40  # per data set
    max_len: int = 768
    out: str | None = None  # directory to write acceptance.json into (default: the drafter's)
    drafter_weights: str = "auto"  # the engine's drafter format (runtime.decoders.load_session_drafter)


def acceptance_table(cfg: AcceptanceTableConfig, session: Session,
                     on_shape: Callable[[str], None] | None = None) -> dict:
    """Measure and write the drafter's ``acceptance.json`` (``io.checkpoints.write_acceptance``);
    returns what was written and where.

    Held-out answers of the training data alone overstate acceptance on prompts unlike it, and more so
    the deeper the draft, so ``--spec-config auto`` over-predicted deep, narrow shapes (drafter v6 against
    Spec-Bench and unseen prompts: docs/LOG.md). Hence more than one data set, each an equal share: the
    training distribution's held-out answers and prompts from elsewhere."""

    sets = [DataSet(d) for d in cfg.data]
    rows_of = [greedy_heldout(ds, cfg.max_len, cfg.samples, "measure acceptance on") for ds in sets]
    target = session.loaded.model
    drafter = load_session_drafter(session, cfg.drafter, cfg.drafter_weights)
    per_position: dict[int, list[float]] = {}
    shapes = {}
    by_set: list[dict] = [{"data": str(ds.root), "samples": len(rows), "per_position_accept": {}}
                          for ds, rows in zip(sets, rows_of, strict=True)]
    for topk, steps in CANDIDATE_TOPK_STEPS.items():
        shape = SpecConfig(max(steps), topk)
        if on_shape:
            on_shape(f"{shape.num_steps} steps, top-{topk}, {shape.num_draft_tokens} tokens")
        engine = Engine(target, session.loaded.tokenizer, Eagle3Decoder(drafter, shape))
        each, total_cycles = [], 0
        for ds, rows, record in zip(sets, rows_of, by_set, strict=True):
            tokens_mm = ds.tokens()
            weighted, cycles = np.zeros(shape.max_depth), 0
            for r in rows:
                start, end = r["loss_ranges"][0]
                end = min(end, cfg.max_len)
                prompt = [int(t) for t in tokens_mm[r["offset"]:r["offset"] + start]]
                result = engine.generate(prompt, GenerateOptions(max_new_tokens=end - start))
                if result.stats.get("cycles"):
                    weighted += np.array(result.stats["per_position_accept"]) * result.stats["cycles"]
                    cycles += result.stats["cycles"]
            each.append(weighted / max(cycles, 1))
            record["per_position_accept"][str(topk)] = [round(float(x), 4) for x in each[-1]]
            total_cycles += cycles
        per_position[topk] = [float(x) for x in np.mean(each, axis=0)]
        shapes[topk] = {"num_steps": shape.num_steps, "num_draft_tokens": shape.num_draft_tokens,
                        "cycles": total_cycles, "accept_length": 1 + float(sum(per_position[topk]))}
    weights = Path(cfg.drafter) / "model.safetensors"
    measured = {"data": [str(d) for d in cfg.data], "split": "heldout", "samples": sum(len(r) for r in rows_of),
                # the weights measured (runtime.autospec ignores a table whose drafter was trained again since)
                **({"drafter_weights": file_fingerprint(weights)} if weights.is_file() else {}),
                "dtype": session.config.dtype, "weights": session.config.weights,
                "drafter_format": detect_format(drafter), "shapes": {str(k): v for k, v in shapes.items()},
                "by_data": by_set,
                "how": "engine, greedy, each held-out prompt answered for its reference answer's length; "
                       "each data set an equal share"}
    path = write_acceptance(cfg.out or cfg.drafter, per_position, measured)
    return {"path": str(path), "per_position_accept": per_position, **measured}
