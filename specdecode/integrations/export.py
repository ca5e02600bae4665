"""Export a drafter for the engines users already run: SGLang, vLLM (and SpecForge, which reads
SGLang's files).

The engines read the SpecForge key layout we write (``fc``, ``midlayer.*``, ``d2t``...); they
differ on ``eagle_aux_hidden_state_layer_ids``: SGLang and SpecForge read ``eagle_config``'s list
and add 1 (id = output of layer id), vLLM reads a top-level list first (id = input of layer id).
Every file we write carries both, naming the same layers, so it needs no per-engine copy; export
turns a drafter from elsewhere (one list, in either place) into such a file, checked against the
target. ``launch`` exports only a drafter that lacks the list its engine reads, and for vLLM
without loading the target (``io.vllm.vllm_copy``: its config says which layers, the files are copied).
``--format speculators`` writes vLLM's speculators layout (RedHat's), which variants need. ``EXPORTERS``
holds every format ``export`` writes, llama.cpp's GGUF (``io.llamacpp``) and OpenVINO IR (``io.openvino``)
included.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ExportOptions:
    """What an export reads besides its format and output: the target (None: the shipped SmolLM2), the drafter
    (None: the one shipped for it), and the per-format settings (the others ignore them)."""

    model: str | None = None
    drafter: str | None = None
    convention: Convention | None = None  # how to read the source drafter's explicit aux ids, where unrecorded
    verifier: str | None = None  # speculators: the target vLLM loads with it
    outtype: str = "f32"  # gguf: the 2-D weights' type
    ov_weights: str = "gguf"  # openvino: GGUF blocks kept compressed, or f32


def _engine_files(fmt: str) -> Callable[[str | Path, ExportOptions], str]:
    def write(out: str | Path, o: ExportOptions) -> str:
        info = export_drafter(o.model, o.drafter, fmt, out, o.convention, verifier=o.verifier)
        taps = info["taps_entering_layers"]
        if info["layout"] == "speculators":
            variant = f", variant {'+'.join(info['variant'])}" if info["variant"] else ""
            return (f"wrote {info['out']} in vLLM's speculators layout{variant}: top-level ids {taps} (vLLM's "
                    f"numbering): the hidden states entering target layers {taps}; serve it with vLLM")
        return (f"wrote {info['out']} for {info['format']}: eagle_config ids {info['aux_ids']} (SGLang's numbering) "
                f"and top-level ids {taps} (vLLM's): the hidden states entering target layers {taps}")
    return write


def _gguf(out: str | Path, o: ExportOptions) -> str:
    from specdecode.io.llamacpp import export_drafter_gguf

    g = export_drafter_gguf(o.model, o.drafter, out, o.outtype)
    return (f"wrote {g['out']} for llama.cpp ({g['outtype']}): eagle3.target_layers {g['target_layers']} (the "
            f"hidden states entering those target layers), draft vocabulary {g['draft_vocab']}, the target's "
            f"tokenizer ({g['tokenizer_keys']} keys); run it with llama-server -m TARGET.gguf -md {g['out']} "
            "--spec-type draft-eagle3")


def _openvino(out: str | Path, o: ExportOptions) -> str:
    from specdecode.io.openvino import export_openvino

    ov = export_openvino(o.model, o.drafter, out, o.ov_weights, convention=o.convention)
    return (f"wrote {ov.target} and {ov.draft} for OpenVINO GenAI ({ov.weights} weights, largest weight difference "
            f"from ours {ov.weight_error:.1e}): GenAI taps the outputs of target layers {ov.hidden_layers} (the "
            f"inputs of layers {[i + 1 for i in ov.hidden_layers]}, as the drafter was trained); run it with "
            f"openvino_genai.LLMPipeline('{ov.target}', 'CPU', draft_model=openvino_genai.draft_model('{ov.draft}', "
            "'CPU'))")


# Every format `specdecode export` writes: its writer, which returns what it wrote in a line.
EXPORTERS: dict[str, Callable[[str | Path, ExportOptions], str]] = {
    **{fmt: _engine_files(fmt) for fmt in FORMATS}, "gguf": _gguf, "openvino": _openvino}


def check_export(fmt: str, options: ExportOptions) -> None:
    """What an export would refuse, said before anything is read or written."""
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORTERS)}")
    if options.verifier and fmt != "speculators":
        raise ValueError("--verifier is written by --format speculators only (vLLM's layout names its target)")


def export(fmt: str, out: str | Path, options: ExportOptions = ExportOptions()) -> str:
    """Write ``options``' drafter (and, for openvino, the target) as ``fmt`` (``EXPORTERS``) into ``out``;
    what was written, in a line."""
    check_export(fmt, options)
    return EXPORTERS[fmt](out, options)

