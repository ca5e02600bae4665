"""Trainer checkpoints: drafter weights, optimizer state (safetensors) and the trainer's
state (JSON), written atomically, so that a killed run resumes exactly: the data order is
a function of (seed, epoch) and the state records the position in it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specdecode.core.drafter import Eagle3Drafter

# settings a resumed run must share with the checkpoint (anything else may change)
RESUME_KEYS = ("draft_vocab_size", "ttt_steps", "data", "seed", "batch_tokens", "max_len", "limit_samples",
               "skip_samples", "init_from", "align_topk", "variant")


def save_checkpoint(path: Path, drafter: Eagle3Drafter, opt: torch.optim.Optimizer, state: dict) -> None:
    """Written beside ``path`` first, then swapped in: a kill leaves the old or the new checkpoint."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous().cpu() for k, v in drafter.state_dict().items()}, str(tmp / "drafter.safetensors"))
    names = {id(p): n for n, p in drafter.named_parameters()}
    opt_tensors = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                opt_tensors[f"{names[id(p)]}::{k}"] = v.detach().clone().reshape(v.shape).contiguous().cpu()
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


def load_checkpoint(path: Path, drafter: Eagle3Drafter, opt: torch.optim.Optimizer,
                    settings: Mapping[str, Any]) -> dict:
    """Restore ``drafter`` and ``opt``; the trainer state. ``settings``: this run's configuration
    (``RESUME_KEYS`` must match the checkpoint's)."""
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
    saved_cfg = {"skip_samples": 0} | state.get("config", {})  # checkpoints from before --skip-samples skipped none
    for key in RESUME_KEYS:
        now = list(settings[key]) if isinstance(settings[key], tuple) else settings[key]  # JSON has lists
        if key in saved_cfg and saved_cfg[key] != now:
            raise ValueError(f"{path}: checkpoint was made with {key}={saved_cfg[key]!r}, this run has "
                             f"{settings[key]!r}; use the same settings or a new --out")
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: checkpoint weights do not fit this drafter: {e}") from None
    params = dict(drafter.named_parameters())
    for key, v in opt_tensors.items():
        name, _, slot = key.partition("::")
        # moments live beside their parameter; AdamW keeps its step count on the CPU
        opt.state[params[name]][slot] = v if slot == "step" else v.to(params[name].device)
    return state

