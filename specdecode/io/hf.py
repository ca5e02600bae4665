"""Hugging Face model directories (config.json + safetensors; Llama, Mistral, Qwen2) -> ``Transformer``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch

from specdecode.core.model import ModelConfig, Transformer
from specdecode.io.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf(cfg: dict[str, Any], source: Path) -> ModelConfig:
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
        # We attend to the whole context; capping the context keeps results exact.
        max_pos = min(max_pos, int(cfg["sliding_window"]))
    # transformers v5 writes "rope_parameters" (theta + scaling); v4 "rope_theta" + "rope_scaling".
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=cast(int, cfg.get("head_dim")),  # None: ModelConfig derives it
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=max_pos,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}/config.json: missing required field {e.args[0]!r}") from None


def read_config_json(model_dir: Path, error: type[Exception] | None = None,
                     what: str = "a model directory") -> dict[str, Any]:
    """config.json of a model/drafter directory, with errors that name the file."""
    error = error or ModelLoadError
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise error(f"{cfg_path}: not found; {what} needs config.json + *.safetensors")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{cfg_path}: invalid JSON ({e})") from None
    return cfg


def read_safetensors(model_dir: Path, error: type[Exception] | None = None) -> dict[str, torch.Tensor]:
    """Every *.safetensors file of a directory (never pickle), with errors that name the file."""
    from safetensors.torch import load_file

    error = error or ModelLoadError
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise error(
            f"{model_dir}: no *.safetensors weights found (pickled .bin checkpoints are not loaded "
            "for safety; convert them to safetensors)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises SafetensorError on truncated/corrupt files
            raise error(f"{f}: cannot read safetensors ({e}); the file may be truncated") from None
    return state


def fuse_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF parameter names onto our module (q/k/v and gate/up fused)."""
    out: dict[str, torch.Tensor] = {}
    state = {k.removeprefix("model."): v for k, v in state.items()}
    out["embed_tokens.weight"] = state.pop("embed_tokens.weight")
    out["norm.weight"] = state.pop("norm.weight")
    lm_head = state.pop("lm_head.weight", None)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]  # re-tied after loading
    elif lm_head is None:
        raise KeyError("lm_head.weight")
    else:
        out["lm_head.weight"] = lm_head
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            present = [x for x in parts if x is not None]
            if len(present) == len(parts):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(present)
        out[f"{p}self_attn.o_proj.weight"] = state.pop(f"{p}self_attn.o_proj.weight")
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            (state.pop(f"{p}mlp.gate_proj.weight"), state.pop(f"{p}mlp.up_proj.weight")))
        out[f"{p}mlp.down_proj.weight"] = state.pop(f"{p}mlp.down_proj.weight")
        out[f"{p}input_layernorm.weight"] = state.pop(f"{p}input_layernorm.weight")
        out[f"{p}post_attention_layernorm.weight"] = state.pop(f"{p}post_attention_layernorm.weight")
    leftovers = [k for k in state if "rotary_emb" not in k]
    if leftovers:
        raise ValueError(f"unexpected weights: {', '.join(leftovers[:5])}")
    return out


def load_hf_dir(model_dir: Path, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    config = config_from_hf(read_config_json(model_dir), model_dir)
    state = read_safetensors(model_dir)
    try:
        state = fuse_hf_state_dict(state, config)
    except KeyError as e:
        raise ModelLoadError(f"{model_dir}: weight {e.args[0]!r} is missing from the safetensors files") from None
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    with torch.device("meta"):
        model = Transformer(config)
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{model_dir}: weights do not match config.json: {e}") from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
