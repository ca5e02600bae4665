"""Test helpers (tiny models, a tiny HF directory, the CLI in a fresh process). Imported by
tests as ``from tests.helpers import ...``; fixtures live in ``conftest.py``."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch

from specdecode.core.model import ModelConfig, Transformer


def tiny_config(**overrides) -> ModelConfig:
    base = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_layers": 6, "num_heads": 4,
                "num_kv_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # larger than default init: logits far from uniform
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval().requires_grad_(False)


def run_specdecode(*args, env=None, check=True, timeout=300):
    """The console script in a fresh process; ``env`` entries set (or, with None, remove)
    variables on top of this process's environment."""
    full_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    proc = subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def save_tiny_hf(tmp_path, model_type="llama", **cfg_overrides):
    import transformers

    common = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                  "rms_norm_eps": 1e-6, "rope_theta": 5000.0, "tie_word_embeddings": False}
    common.update(cfg_overrides)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def perturbed(model, scale, seed):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return other
