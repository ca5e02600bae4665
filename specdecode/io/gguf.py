"""GGUF (llama architecture) -> a Hugging Face style directory, converted once into the cache.

A GGUF is dequantized into ``cache_root()/<stem>-<fingerprint>/`` (safetensors + config.json +
tokenizer files); every later load reads that directory, so both sources share one loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from specdecode.core.model import DecoderLayer, Transformer
from specdecode.core.quant import Int4Linear
from specdecode.io.errors import ModelLoadError
from specdecode.io.paths import cache_root, file_fingerprint, share_readable

if TYPE_CHECKING:
    from gguf import GGUFReader

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


def _unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's converter interleaves the two rotary halves of each Q/K head
    (its RoPE rotates adjacent pairs); undo it to get the rotate-half layout of HF."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``_unpermute_rope_rows``: HF's rotate-half rows of a Q/K projection in the
    adjacent-pair layout llama.cpp's RoPE expects (what its converter writes)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def open_gguf(path: Path) -> GGUFReader:
    """The one way a GGUF is opened here: a file the gguf package cannot read (a copy cut short, a
    download that stopped, another format) is a ModelLoadError saying so, with its size.

    The parsed reader is kept per process (keyed by path, size and modification time): gguf's
    reader parses every metadata string with numpy views, 9-10 s for SmolLM2's 49k-token vocabulary
    and 49k merges on a 2-core EPYC (a first start converts the file and writes ``gguf_index``
    from the same parse). Before the index, a ``bench`` start parsed the file three times: 28 s of
    its 42 s there."""
    try:
        stat = path.stat()
    except OSError:
        stat = None
    return _read_gguf(str(path), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFReader:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({max(size, 0):,} bytes; "
                             f"{type(e).__name__}: {e}); copy or download it again") from e


INDEX_VERSION = 1  # bump when GGUFIndex's fields change


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of a GGUF's tensor table: ggml type name, shape in ggml order (fastest-varying
    first), and where its bytes are in the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """What a start needs of a GGUF without parsing it: its scalar metadata (the tokenizer's arrays
    left out) and its tensor table, read once per file by gguf's reader and kept beside the
    converted directory (``gguf_index``)."""

    path: Path
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def raw(self, name: str) -> Any:
        """A tensor's bytes, memory-mapped (uint8, nothing read until used)."""
        import numpy as np

        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.n_bytes,))


def gguf_index(gguf_path: Path) -> GGUFIndex:
    """A GGUF's ``GGUFIndex``: from ``cache_root()/gguf-index/<stem>-<fingerprint>.json`` when a
    start has written it, else parsed (``open_gguf``) and written there. The fingerprint covers the
    size and the first and last MiB, as for the converted directory. Measured on a 2-core EPYC:
    the parse 9.7 s for the default model, the index file milliseconds."""
    try:
        fingerprint = file_fingerprint(gguf_path)
    except OSError:
        open_gguf(gguf_path)  # the reader's error, naming the path
        raise
    where = cache_root() / "gguf-index" / f"{gguf_path.stem}-{fingerprint}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(where.read_text())
        if saved["version"] == INDEX_VERSION:
            return GGUFIndex(gguf_path, saved["fields"],
                             {t["name"]: GGUFTensor(t["name"], t["kind"], tuple(t["shape"]), t["offset"],
                                                    t["n_bytes"]) for t in saved["tensors"]})
    reader = open_gguf(gguf_path)
    fields = {}
    for key, field in reader.fields.items():
        if len(field.types) == 1 and field.types[0].name != "ARRAY":  # scalars and strings
            with contextlib.suppress(Exception):  # a value gguf cannot decode is left out, not fatal
                value = field.contents()
                json.dumps(value)
                fields[key] = value
    tensors = [GGUFTensor(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset),
                          int(t.n_bytes)) for t in reader.tensors]
    index = GGUFIndex(gguf_path, fields, {t.name: t for t in tensors})
    with contextlib.suppress(OSError):  # a read-only cache costs the next start a parse, nothing else
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": INDEX_VERSION, "fields": fields,
                                   "tensors": [dataclasses.asdict(t) for t in tensors]}))
        tmp.replace(where)
    return index


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama-architecture GGUF into ``out_dir`` as an HF model directory."""
    import gguf
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"llama.{key}", default)

    if meta("block_count") is None or meta("attention.head_count") is None:
        raise ModelLoadError(f"{gguf_path}: GGUF metadata lacks llama.block_count / llama.attention.head_count")
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
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
        # the dtype engines serve it in (SGLang takes fp16 where none is written; drafters train in bf16):
        # "torch_dtype" for transformers 4 readers, "dtype" for transformers 5
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    if meta("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{gguf_path}: RoPE scaling in GGUF metadata is not supported yet")

    tensors: dict[str, Tensor] = {}
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

    # "format": "pt" is what transformers 4.x requires of a safetensors file; the source by name only (the
    # directory moves between machines, a local path says nothing there)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    share_readable(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name (TokenizersBackend), which transformers 4 (SGLang's, vLLM's)
    # does not know; PreTrainedTokenizerFast reads the same tokenizer.json in both (same ids, same chat prompt)
    tok_cfg = out_dir / "tokenizer_config.json"
    tok_json = json.loads(tok_cfg.read_text())
    tok_json["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.write_text(json.dumps(tok_json, indent=2))


CONVERSION = "c3"  # bump when what convert_gguf writes changes (c2: torch_dtype, a transformers-4 tokenizer class;
# c3: safetensors' format tag, no local path)


def gguf_cache_path(gguf_path: Path) -> Path:
    """Where a GGUF's converted HF directory is (or will be), converting nothing."""
    return cache_root() / f"{gguf_path.stem}-{file_fingerprint(gguf_path)}-{CONVERSION}"


def gguf_head_counts(gguf_path: Path) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) from a GGUF's header, without converting it."""
    index = gguf_index(gguf_path)
    heads = index.field("llama.attention.head_count")
    kv = index.field("llama.attention.head_count_kv", heads)
    return (int(heads) if heads is not None else None, int(kv) if kv is not None else None)


def gguf_cache_dir(gguf_path: Path) -> Path:
    """The converted HF directory for a GGUF, creating it (atomically) on first use."""
    out = gguf_cache_path(gguf_path)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp)
        share_readable(tmp)  # vLLM or SGLang may run as another user
        with contextlib.suppress(OSError):  # another process converted it first
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in out.parent.glob(out.name.rsplit("-", 1)[0] + "-c*"):  # this GGUF's earlier conversions
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out


# ggml's 4-bit blocks: 32 weights each. Q4_0: fp16 d, then 16 bytes of nibbles, w = d * (q - 8);
# Q4_1: fp16 d, fp16 m, then the nibbles, w = d * q + m. Byte j holds weight j (low nibble) and
# weight j + 16 (high nibble).
_Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def q4_layer_count(gguf_path: Path) -> int:
    """How many of a GGUF's layer tensors (``blk.*``) are Q4_0/Q4_1 blocks (what ``--weights q4``
    runs); read from its tensor table (``gguf_index``)."""
    tensors = gguf_index(gguf_path).tensors
    return sum(name.startswith("blk.") and t.kind in _Q4_BLOCK_BYTES for name, t in tensors.items())


def q4_blocks(raw: Any, kind: str, rows: int, cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """A Q4_0/Q4_1 tensor's raw bytes [rows, cols / 32 * block bytes] -> (q [rows, cols] in 0..15,
    scales, zeros [rows, cols / 32] float32) with w = (q - 8) * scale + zero."""
    import numpy as np

    size = _Q4_BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // 32, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else np.zeros_like(d)
    nibbles = blocks[..., size - 16:]
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    zeros = m + 8 * d if kind == "Q4_1" else m  # d * q + m = d * (q - 8) + (m + 8d)
    return torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zeros)


def q8_blocks(raw: Any, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """A Q8_0 tensor's raw bytes (blocks of 32: fp16 d, then 32 int8) -> (q [rows, cols] int8, scales
    [rows, cols / 32] float32) with w = q * scale."""
    import numpy as np

    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d)


# our fused linear layers -> the GGUF tensors they are made of, in order
Q4_PROJECTIONS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
                  "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}


def q4_layer_blocks(index: GGUFIndex, layer: int, proj: str) -> tuple[Tensor, Tensor, Tensor] | None:
    """Layer ``layer``'s fused linear ``proj`` (``Q4_PROJECTIONS``) as the file's own 4-bit blocks (q, scale,
    zero) in our row order (Q/K rows un-permuted as the loader does), or None when a part is not Q4_0/Q4_1."""
    n_heads = int(index.field("llama.attention.head_count"))
    n_kv = int(index.field("llama.attention.head_count_kv", n_heads))
    parts = []
    for kind in Q4_PROJECTIONS[proj]:
        t = index.tensors.get(f"blk.{layer}.{kind}.weight")
        if t is None or t.kind not in _Q4_BLOCK_BYTES:
            return None
        cols, rows = t.shape  # ggml order: fastest-varying first
        q, s, z = q4_blocks(index.raw(f"blk.{layer}.{kind}.weight"), t.kind, rows, cols)
        if kind in ("attn_q", "attn_k"):
            heads = n_heads if kind == "attn_q" else n_kv
            q, s, z = (_unpermute_rope_rows(x, heads) for x in (q, s, z))
        parts.append((q, s, z))
    q, s, z = (torch.cat([p[i] for p in parts]) for i in range(3))
    return q, s, z


def apply_gguf_q4(model: nn.Module, gguf_path: Path, dtype: torch.dtype) -> int:
    """Replace ``model``'s fused linear layers (qkv, o, gate_up, down of every layer) whose GGUF
    tensors are all Q4_0/Q4_1 with ``core.quant.Int4Linear`` on the file's own blocks (Q/K rows
    un-permuted as the loader does). Returns how many layers changed; the caller puts the rest
    (e.g. a Q8_0 lm_head) in another format."""
    if not isinstance(model, Transformer):
        raise TypeError("apply_gguf_q4 takes a core.model.Transformer")
    index = gguf_index(gguf_path)

    def fused(layer: int, proj: str) -> Int4Linear | None:
        blocks = q4_layer_blocks(index, layer, proj)
        return None if blocks is None else Int4Linear(*blocks, dtype)

    changed = 0
    for i, layer in enumerate(model.layers):
        layer = cast(DecoderLayer, layer)
        attn, mlp = layer.self_attn, layer.mlp
        swaps = ((attn, "qkv_proj", fused(i, "qkv_proj")), (attn, "o_proj", fused(i, "o_proj")),
                 (mlp, "gate_up_proj", fused(i, "gate_up_proj")), (mlp, "down_proj", fused(i, "down_proj")))
        for parent, attr, new in swaps:
            if new is not None:
                old = getattr(parent, attr)
                if (new.out_features, new.in_features) != (old.out_features, old.in_features):
                    raise ModelLoadError(f"{gguf_path}: 4-bit {attr} of layer {i} is {new.out_features}x"
                                         f"{new.in_features}, the model's {old.out_features}x{old.in_features}")
                setattr(parent, attr, new.to(old.weight.device))
                changed += 1
    return changed
