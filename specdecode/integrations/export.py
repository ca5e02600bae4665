"""Export a drafter for the engines users already run: SGLang, vLLM (and SpecForge, which reads
SGLang's files).

The engines read the SpecForge key layout we write (``fc``, ``midlayer.*``, ``d2t``...); they
differ on ``eagle_aux_hidden_state_layer_ids``: SGLang and SpecForge read ``eagle_config``'s list
and add 1 (id = output of layer id), vLLM reads a top-level list first (id = input of layer id).
Every file we write carries both, naming the same layers, so it needs no per-engine copy; export
turns a drafter from elsewhere (one list, in either place) into such a file, checked against the
target. ``launch`` exports only a drafter that lacks the list its engine reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.io.checkpoints import CONVENTION_KEY, Convention, load_drafter, save_drafter
from specdecode.io.loading import load_model
from specdecode.io.paths import default_drafter_path

ENGINES = ("sglang", "vllm")


def export_drafter(model: str | None, drafter: str | Path | None, fmt: Convention, out: str | Path,
                   source_convention: Convention | None = None) -> dict:
    """Write ``drafter`` (validated against the target) in engine ``fmt``'s convention; the
    taps entering target layers stay the same. Returns what was written."""
    import torch


    path = drafter or default_drafter_path()
    if path is None:
        raise ValueError("no drafter given and no shipped drafter for this model: pass --drafter DIR")
    loaded = load_model(model, "float32", "cpu")
    head = load_drafter(path, loaded.model, convention=source_convention)
    src_cfg = json.loads((Path(path) / "config.json").read_text())
    dtype = {"bfloat16": "bfloat16", "float16": "float16"}.get(src_cfg.get("torch_dtype"), "float32")
    save_drafter(head, out, dtype=getattr(torch, dtype))  # the same file for every engine (see the module doc)
    written = json.loads((Path(out) / "config.json").read_text())
    return {"source": str(path), "out": str(out), "format": fmt,
            "aux_ids": written["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            "taps_entering_layers": list(head.config.aux_layer_ids)}


def read_drafter_config(drafter_dir: str | Path) -> dict:
    """A drafter's config.json ({} when unreadable: the engine will say why)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def recorded_convention(drafter_dir: str | Path) -> str | None:
    """The aux-layer-id convention a drafter's config.json records (None: not recorded, or unreadable)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (cfg.get("eagle_config") or {}).get(CONVENTION_KEY)
