"""Export a drafter for the engines users already run: SGLang, vLLM (and SpecForge, which reads
SGLang's files).

The engines read the SpecForge key layout we write (``fc``, ``midlayer.*``, ``d2t``...); they
differ on ``eagle_aux_hidden_state_layer_ids``: SGLang and SpecForge read ``eagle_config``'s list
and add 1 (id = output of layer id), vLLM reads a top-level list first (id = input of layer id).
Every file we write carries both, naming the same layers, so it needs no per-engine copy; export
turns a drafter from elsewhere (one list, in either place) into such a file, checked against the
target. ``launch`` exports only a drafter that lacks the list its engine reads, and for vLLM
without loading the target (``io.vllm.vllm_copy``: its config says which layers, the files are copied).
``--format speculators`` writes vLLM's speculators layout (RedHat's), which variants need.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.io.checkpoints import AUX_IDS_KEY, CONVENTION_KEY, Convention, load_drafter, save_drafter
from specdecode.io.loading import load_model, resolve_model_dir
from specdecode.io.paths import default_drafter_path

ENGINES = ("sglang", "vllm")
FORMATS = (*ENGINES, "speculators")  # what export writes: the engines' shared layout, or vLLM's speculators one


def export_drafter(model: str | None, drafter: str | Path | None, fmt: str, out: str | Path,
                   source_convention: Convention | None = None, verifier: str | None = None) -> dict:
    """Write ``drafter`` (validated against the target) for ``fmt`` (``FORMATS``); the taps entering
    target layers stay the same. ``verifier``: what the speculators layout names as the target, which vLLM
    loads with it (default: the target's Hugging Face directory, which vLLM can read). Returns what was written."""
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    path = drafter or default_drafter_path()
    if path is None:
        raise ValueError("no drafter given and no shipped drafter for this model: pass --drafter DIR")
    loaded = load_model(model, "float32", "cpu")
    head = load_drafter(path, loaded.model, convention=source_convention)
    src_cfg = json.loads((Path(path) / "config.json").read_text())
    dtype = {"bfloat16": "bfloat16", "float16": "float16"}.get(src_cfg.get("torch_dtype"), "float32")
    # sglang and vllm: the same file for every engine (see the module doc); a variant goes in speculators' layout
    target_dir = str(resolve_model_dir(model)[1].resolve())
    save_drafter(head, out, dtype=getattr(torch, dtype), layout="speculators" if fmt == "speculators" else None,
                 verifier=verifier or target_dir)
    written = json.loads((Path(out) / "config.json").read_text())
    nested = (written.get("eagle_config") or {}).get(AUX_IDS_KEY)
    return {"source": str(path), "out": str(out), "format": fmt, "layout": "eagle_config" if nested else "speculators",
            "aux_ids": nested if nested else written[AUX_IDS_KEY],
            "taps_entering_layers": list(head.config.aux_layer_ids), "variant": list(head.config.variant)}


def recorded_convention(drafter_dir: str | Path) -> str | None:
    """The aux-layer-id convention a drafter's config.json records (None: not recorded, or unreadable)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (cfg.get("eagle_config") or {}).get(CONVENTION_KEY)
