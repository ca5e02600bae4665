"""OpenVINO IR of a target and our EAGLE-3 drafter, laid out the way OpenVINO GenAI's ``LLMPipeline`` reads them
(``export --format openvino``; the ``openvino`` bench method runs them). The graphs are built here op by op from
our own readers, not by optimum-intel, whose pins (transformers < 5.6, torchvision) would replace this project's
torch and transformers. What GenAI looks for in them (stateful KV chains, layer outputs found by name, ``fc``,
``d2t``, the rt_info keys) is listed in docs/interop.md. Weights: ``gguf`` keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks as
OpenVINO's group-wise compressed weights (a Q4_1 block's minimum as a float zero point: ``weight_error`` says how
close); everything else, and ``f32``, stays float32."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdecode.core.attention import rope_inv_freq
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.model import ModelConfig
from specdecode.io.checkpoints import Convention, load_drafter
from specdecode.io.gguf import gguf_index, q4_layer_blocks, q8_blocks
from specdecode.io.loading import LoadedModel, load_model
from specdecode.io.paths import cache_root, dir_digest, file_fingerprint, shipped_drafter_for

OV_WEIGHTS = ("gguf", "f32")
OV_EXPORT_VERSION = "ov-1"  # recorded in export.json: bump when the layout of what export_openvino writes changes
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml",
                   "openvino_detokenizer.bin")


def openvino_modules() -> tuple[Any, Any]:
    """(openvino, its opset13), or a ValueError that names the extra to install."""
    try:
        import openvino as ov
        import openvino.opset13 as ops
        import openvino_tokenizers  # noqa: F401  (the export writes GenAI's tokenizer with it)
    except ImportError as e:
        raise ValueError(f"OpenVINO is not installed ({e}): pip install 'specdecode[openvino]'") from None
    return ov, ops


@dataclass
class Blocks:
    """A group-wise compressed weight [rows, cols]: w = (q - zero_point) * scale per group of 32 columns."""

    q: np.ndarray  # [rows, cols] integers (u4 range 0..15, or i8)
    scale: np.ndarray  # [rows, cols / 32] float32
    zero_point: np.ndarray | None  # [rows, cols / 32] float32, None: symmetric
    kind: str  # "u4" or "i8"

    def dequantized(self) -> np.ndarray:
        rows, cols = self.q.shape
        q = self.q.reshape(rows, cols // 32, 32).astype(np.float32)
        zp = 0.0 if self.zero_point is None else self.zero_point[..., None]
        return ((q - zp) * self.scale[..., None]).reshape(rows, cols)


def q4_as_blocks(q: Tensor, scale: Tensor, zero: Tensor) -> Blocks:
    """Our 4-bit blocks (w = (q - 8) * scale + zero) as OpenVINO's (w = (q - zp) * scale, zp = 8 - zero / scale);
    a block with scale 0 holds one value, which a zero point cannot give unless it is 0."""
    s, z = scale.numpy().astype(np.float32), zero.numpy().astype(np.float32)
    safe = np.where(s == 0, 1.0, s)
    zp = np.where(s == 0, 0.0, 8.0 - z / safe).astype(np.float32)
    return Blocks(q.numpy(), s, zp, "u4")


def owned_tensor(raw: np.ndarray, shape: list[int], kind: Any) -> Any:
    """An OpenVINO tensor of type ``kind`` holding a copy of ``raw``'s bytes (a tensor made on a numpy array
    shares its memory, which a constant would read after the array is gone)."""
    import openvino as ov

    t = ov.Tensor(kind, shape)
    np.copyto(t.data, np.ascontiguousarray(raw).view(t.data.dtype).reshape(t.data.shape))
    return t


class Graph:
    """Builds one model: ops with the names GenAI looks for, weights as constants (compressed or float32)."""

    def __init__(self, ops: Any, cfg: ModelConfig) -> None:
        self.ops, self.cfg = ops, cfg
        self.params: list[Any] = []
        self.assigns: list[Any] = []  # each layer's keys and values, kept as state between calls
        self.input_ids = self.param("input_ids", np.int64, [-1, -1])
        self.attention_mask = self.param("attention_mask", np.int64, [-1, -1])
        self.position_ids = self.param("position_ids", np.int64, [-1, -1])
        self.beam_idx = self.param("beam_idx", np.int32, [-1])
        self.inv_freq = rope_inv_freq(cfg).numpy().astype(np.float32)
        self.mask = self._mask()
        self.cos, self.sin = self._rope_tables()

    def empty_kv(self, heads: int, dim: int) -> Any:
        """A state's first value: no keys yet, [B, heads, 0, dim] with B the batch of input_ids."""
        ops = self.ops
        batch = ops.gather(ops.shape_of(self.input_ids), self.const([0], np.int64), self.const(0, np.int64))
        shape = ops.concat([batch, self.const([heads, 0, dim], np.int64)], 0)
        return ops.broadcast(self.const(0.0), shape)

    def param(self, name: str, dtype: Any, shape: list[int]) -> Any:
        p = self.ops.parameter(shape, dtype, name=name)
        p.output(0).get_tensor().set_names({name})
        self.params.append(p)
        return p

    def const(self, value: Any, dtype: Any = np.float32) -> Any:
        return self.ops.constant(np.asarray(value, dtype=dtype))

    def weight(self, w: Tensor | Blocks, name: str) -> Any:
        """A [rows, cols] weight as an f32 value: a float32 constant (bf16 and f16 kept and converted, exact),
        or OpenVINO's decompression pattern over the blocks, which its CPU plugin runs as compressed weights."""
        ops = self.ops
        if isinstance(w, Tensor):
            t = w.detach().cpu()
            if t.dtype in (torch.bfloat16, torch.float16):
                import openvino as ov

                kind = ov.Type.bf16 if t.dtype == torch.bfloat16 else ov.Type.f16
                c = ops.constant(owned_tensor(t.view(torch.int16).numpy(), list(t.shape), kind), name=name)
                return ops.convert(c, np.float32)
            return ops.constant(t.float().numpy(), name=name)
        import openvino as ov

        rows, cols = w.q.shape
        groups = cols // 32
        if w.kind == "u4":  # two to a byte, the first in the low nibble (OpenVINO's u4 layout)
            pairs = w.q.astype(np.uint8).reshape(-1, 2)
            packed = (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8)
            q = ops.constant(owned_tensor(packed, [rows, groups, 32], ov.Type.u4), name=name)
        else:
            q = ops.constant(w.q.reshape(rows, groups, 32).astype(np.int8), name=name)
        x = ops.convert(q, np.float32)
        if w.zero_point is not None:
            x = ops.subtract(x, self.const(w.zero_point.reshape(rows, groups, 1)))
        s = ops.constant(w.scale.reshape(rows, groups, 1).astype(np.float16))
        x = ops.multiply(x, ops.convert(s, np.float32))
        return ops.reshape(x, self.const([rows, cols], np.int64), False)

    def linear(self, x: Any, w: Any, bias: Tensor | None = None) -> Any:
        y = self.ops.matmul(x, w, False, True)
        return y if bias is None else self.ops.add(y, self.const(bias.float().numpy()))

    def rms_norm(self, x: Any, w: Tensor) -> Any:
        ops = self.ops
        var = ops.reduce_mean(ops.multiply(x, x), self.const([-1], np.int64), True)
        normed = ops.multiply(x, ops.divide(self.const(1.0), ops.sqrt(ops.add(var, self.const(self.cfg.rms_norm_eps)))))
        return ops.multiply(normed, self.const(w.float().numpy()))

    def _mask(self) -> Any:
        """[B, 1, T, S] additive: query t (at position_ids[t]) sees key s when s <= its position and
        attention_mask[s] is set (keys are the cache's slots 0..S-1, S = attention_mask's length)."""
        ops = self.ops
        total = ops.gather(ops.shape_of(self.attention_mask), self.const(1, np.int64), self.const(0, np.int64))
        keys = ops.range(self.const(0, np.int64), total, self.const(1, np.int64), "i64")  # [S]
        causal = ops.less_equal(keys, ops.unsqueeze(self.position_ids, self.const(-1, np.int64)))  # [B, T, S]
        seen = ops.unsqueeze(ops.convert(self.attention_mask, np.bool_), self.const(1, np.int64))  # [B, 1, S]
        allowed = ops.logical_and(causal, seen)
        blocked = self.const(np.finfo(np.float32).min)
        return ops.unsqueeze(ops.select(allowed, self.const(0.0), blocked), self.const(1, np.int64))

    def _rope_tables(self) -> tuple[Any, Any]:
        """cos and signed sin [B, 1, T, D] (as ``core.attention.rope_cos_sin``)."""
        ops = self.ops
        pos = ops.unsqueeze(ops.convert(self.position_ids, np.float32), self.const(-1, np.int64))
        freqs = ops.multiply(pos, self.const(self.inv_freq))  # [B, T, D/2]
        sin = ops.sin(freqs)
        one = self.const(1, np.int64)
        cos = ops.unsqueeze(ops.cos(ops.concat([freqs, freqs], -1)), one)
        return cos, ops.unsqueeze(ops.concat([ops.negative(sin), sin], -1), one)

    def rope(self, x: Any) -> Any:
        ops = self.ops
        half = ops.split(x, self.const(-1, np.int64), 2)
        rotated = ops.concat([half.output(1), half.output(0)], -1)  # with the signed sin: rotate_half
        return ops.add(ops.multiply(x, self.cos), ops.multiply(rotated, self.sin))

    def attention(self, x: Any, layer: int, qkv: Any, o: Any, qkv_bias: Tensor | None = None) -> Any:
        """x [B, T, in] -> [B, T, H]; this layer's keys and values go to state (past_key_values.{layer}.*)."""
        from openvino import PartialShape

        ops, c = self.ops, self.cfg
        nq, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        parts = ops.variadic_split(self.linear(x, qkv, qkv_bias), self.const(-1, np.int64),
                                   self.const([nq * d, nkv * d, nkv * d], np.int64))

        def heads(t: Any, n: int) -> Any:  # [B, T, n*d] -> [B, n, T, d]
            return ops.transpose(ops.reshape(t, self.const([0, 0, n, d], np.int64), True),
                                 self.const([0, 2, 1, 3], np.int64))

        q = self.rope(heads(parts.output(0), nq))
        current = {"key": self.rope(heads(parts.output(1), nkv)), "value": heads(parts.output(2), nkv)}
        full = {}
        for kind, new in current.items():
            state = f"past_key_values.{layer}.{kind}"
            past = ops.read_value(self.empty_kv(nkv, d), state, np.float32, PartialShape([-1, nkv, -1, d]), name=state)
            cat = ops.concat([ops.gather(past, self.beam_idx, self.const(0, np.int64)), new], 2)
            self.assigns.append(ops.assign(cat, state))
            if nq != nkv:  # grouped queries: each kv head repeated for its queries (the shape GenAI's pass reads)
                cat = ops.unsqueeze(cat, self.const(2, np.int64))
                cat = ops.broadcast(cat, self.const([1, 1, nq // nkv, 1, 1], np.int64), broadcast_spec="BIDIRECTIONAL")
                cat = ops.reshape(cat, self.const([0, nq, -1, d], np.int64), True)
            full[kind] = cat
        out = ops.scaled_dot_product_attention(q, full["key"], full["value"], self.mask)
        out = ops.reshape(ops.transpose(out, self.const([0, 2, 1, 3], np.int64)), self.const([0, 0, nq * d], np.int64),
                          True)
        return self.linear(out, o)

    def mlp_residual(self, h: Any, x: Any, gate_up: Any, down: Any, name: str) -> Any:
        """h + down(silu(gate(x)) * up(x)), the Add named ``name`` (GenAI finds a layer's output by it)."""
        ops = self.ops
        gu = ops.split(self.linear(x, gate_up), self.const(-1, np.int64), 2)
        act = ops.multiply(ops.swish(gu.output(0)), gu.output(1))
        out = ops.add(h, self.linear(act, down))
        out.set_friendly_name(name)
        return out

    def model(self, logits: Any, extra: Sequence[Any] = ()) -> Any:
        """The ov.Model: its outputs, its inputs and its state's assignments."""
        import openvino as ov

        out = self.ops.result(logits, name="logits")
        out.output(0).get_tensor().set_names({"logits"})
        return ov.Model([out, *extra], self.assigns, self.params, "model")


def target_weights(loaded: LoadedModel, weights: str) -> dict[str, Tensor | Blocks]:
    """name -> weight of the target's graph: with ``weights="gguf"`` the GGUF's own blocks where a layer's fused
    linear is all Q4_0/Q4_1 and where the token embedding is Q8_0; everything else our loaded float32 tensors (Q/K
    rows in our order, as the loader makes them)."""
    out: dict[str, Tensor | Blocks] = dict(loaded.model.state_dict())
    source = loaded.source
    if weights != "gguf" or source.suffix.lower() != ".gguf":
        return out
    index = gguf_index(source)
    for i in range(loaded.model.config.num_layers):
        for proj, parent in (("qkv_proj", "self_attn"), ("o_proj", "self_attn"), ("gate_up_proj", "mlp"),
                             ("down_proj", "mlp")):
            blocks = q4_layer_blocks(index, i, proj)
            if blocks is not None and not bool(((blocks[1] == 0) & (blocks[2] != 0)).any()):
                # (a block of one nonzero value, scale 0, has no zero point: that tensor stays float32)
                out[f"layers.{i}.{parent}.{proj}.weight"] = q4_as_blocks(*blocks)
    t = index.tensors.get("token_embd.weight")
    if t is not None and t.kind == "Q8_0":
        cols, rows = t.shape
        q, scale = q8_blocks(index.raw("token_embd.weight"), rows, cols)
        out["embed_tokens.weight"] = Blocks(q.numpy(), scale.numpy(), None, "i8")
    return out


class Weights:
    """A state dict read by name, which remembers what was read: a graph that leaves a weight unread would
    compute something else than the model (``unread`` names them)."""

    def __init__(self, state: dict[str, Tensor | Blocks]) -> None:
        self.state, self.read = state, set[str]()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return self.state[name]

    def get(self, name: str) -> Any:
        return self[name] if name in self.state else None

    def check_all_read(self, source: str, ignore: tuple[str, ...] = ()) -> None:
        unread = sorted(k for k in set(self.state) - self.read if not k.endswith(ignore))
        if unread:
            more = " ..." if len(unread) > 4 else ""
            raise ValueError(f"{source}: the OpenVINO graph has no place for {', '.join(unread[:4])}{more}; this "
                             "architecture cannot be exported to OpenVINO yet")


def build_target(ov_ops: Any, cfg: ModelConfig, state: dict[str, Tensor | Blocks], source: str = "target") -> Any:
    g = Graph(ov_ops, cfg)
    ops, w = g.ops, Weights(state)
    table = g.weight(w["embed_tokens.weight"], "model.embed_tokens.weight")
    h = ops.gather(table, g.input_ids, g.const(0, np.int64))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        x = g.rms_norm(h, w[p + "input_layernorm.weight"])
        a = g.attention(x, i, g.weight(w[p + "self_attn.qkv_proj.weight"], f"model.{p}qkv"),
                        g.weight(w[p + "self_attn.o_proj.weight"], f"model.{p}o"), w.get(p + "self_attn.qkv_proj.bias"))
        h = ops.add(h, a)
        x = g.rms_norm(h, w[p + "post_attention_layernorm.weight"])
        h = g.mlp_residual(h, x, g.weight(w[p + "mlp.gate_up_proj.weight"], f"model.{p}gate_up"),
                           g.weight(w[p + "mlp.down_proj.weight"], f"model.{p}down"), f"model.layers.{i}/mlp_add")
    x = g.rms_norm(h, w["norm.weight"])
    untied = not cfg.tie_word_embeddings and "lm_head.weight" in state
    head = g.weight(w["lm_head.weight"], "lm_head") if untied else table
    w.check_all_read(source, ignore=("inv_freq", "lm_head.weight"))
    return g.model(g.linear(x, head))


def build_draft(ov_ops: Any, drafter: Eagle3Drafter, embedding: Tensor | Blocks) -> Any:
    """The draft IR: ``hidden_states`` [B, T, 3H] through ``fc`` (GenAI moves it into the target and then feeds
    H-wide states: its last dimension stays dynamic), the layer, the head; ``d2t`` as an output."""
    cfg = drafter.config
    g = Graph(ov_ops, cfg.layer)
    ops = g.ops
    hidden = g.param("hidden_states", np.float32, [-1, -1, -1])
    st = Weights(dict(drafter.state_dict()))
    h = g.linear(hidden, g.weight(st["fc.weight"], "fc.weight"))
    table = g.weight(embedding, "model.embed_tokens.weight")
    emb = ops.gather(table, g.input_ids, g.const(0, np.int64))
    m = "midlayer."
    normed = g.rms_norm(h, st[m + "hidden_norm.weight"])
    x = ops.concat([g.rms_norm(emb, st[m + "input_layernorm.weight"]), normed], -1)
    residual = normed if cfg.norm_before_residual else h
    a = g.attention(x, 0, g.weight(st[m + "self_attn.qkv_proj.weight"], "midlayer.qkv"),
                    g.weight(st[m + "self_attn.o_proj.weight"], "midlayer.o"), st.get(m + "self_attn.qkv_proj.bias"))
    h = ops.add(residual, a)
    x = g.rms_norm(h, st[m + "post_attention_layernorm.weight"])
    h = g.mlp_residual(h, x, g.weight(st[m + "mlp.gate_up_proj.weight"], "midlayer.gate_up"),
                       g.weight(st[m + "mlp.down_proj.weight"], "midlayer.down"), "midlayer/mlp_add")
    logits = g.linear(g.rms_norm(h, st["norm.weight"]), g.weight(st["lm_head.weight"], "lm_head.weight"))
    d2t = ops.constant(st["d2t"].cpu().numpy().astype(np.int64), name="d2t")
    st.check_all_read("the drafter", ignore=("t2d",))
    d2t_out = ops.result(d2t, name="d2t")
    d2t_out.output(0).get_tensor().set_names({"d2t"})
    return g.model(logits, [d2t_out])


def genai_layers(drafter: Eagle3Drafter) -> list[int]:
    """GenAI's ``hidden_layers_list``: it taps the outputs of these layers, ours tap the inputs of the next."""
    ids = [i - 1 for i in drafter.config.aux_layer_ids]
    if min(ids) < 0:
        raise ValueError(f"the drafter taps the input of layer 0 (aux ids {list(drafter.config.aux_layer_ids)}), "
                         "the embeddings; OpenVINO GenAI taps decoder-layer outputs only: use a drafter whose aux "
                         "ids are all >= 1")
    return ids


def check_genai_variant(drafter: Eagle3Drafter, source: str) -> None:
    """GenAI moves ``fc`` alone into the target and feeds the layer's pre-norm output back: a variant with
    norms around fc, or with post-norm feedback, would run wrong there."""
    bad = [v for v in drafter.config.variant if v in ("fc_norm", "norm_before_fc", "norm_output")]
    if bad:
        raise ValueError(f"{source}: a drafter with {'+'.join(bad)} cannot run in OpenVINO GenAI (it moves fc alone "
                         "into the target and feeds back the pre-norm state); export a plain EAGLE-3 drafter")


def write_tokenizer(loaded: LoadedModel, out: Path) -> None:
    """GenAI's tokenizer and detokenizer IRs (openvino-tokenizers) from the target's Hugging Face tokenizer."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(loaded.model_dir))
    tok, detok = convert_tokenizer(hf, with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(out / "openvino_detokenizer.xml"))


@dataclass
class OpenVINOExport:
    target: Path
    draft: Path | None
    hidden_layers: list[int]
    weights: str
    weight_error: float  # max |w - ours| over the compressed weights (0 when all float32)

    def to_dict(self) -> dict[str, Any]:
        """What export.json records (the directories by name: the export may move)."""
        return {"target": self.target.name, "draft": self.draft.name if self.draft else None,
                "hidden_layers_list": self.hidden_layers, "weights": self.weights, "weight_error": self.weight_error}

    @classmethod
    def read(cls, out: Path) -> OpenVINOExport:
        d = json.loads((out / "export.json").read_text())
        return cls(out / d["target"], out / d["draft"] if d["draft"] else None, d["hidden_layers_list"],
                   d["weights"], d["weight_error"])


def drafter_for(model: str | None, drafter: str | Path | None, with_drafter: bool) -> Path | None:
    """The drafter an export writes: the one given, else the one shipped for this model; None without one."""
    if not with_drafter:
        return None
    path = Path(drafter) if drafter else shipped_drafter_for(model)
    if path is None:
        raise ValueError("no drafter given and none ships for this model: pass --drafter DIR (or export the target "
                         "alone)")
    return path


def export_openvino(model: str | None, drafter: str | Path | None, out: str | Path, weights: str = "gguf",
                    with_drafter: bool = True, convention: Convention | None = None) -> OpenVINOExport:
    """Write ``out/target`` (and ``out/draft``: ``drafter``, else the one shipped for ``model``) as OpenVINO IR for
    GenAI: ``LLMPipeline(out/target, "CPU", draft_model=draft_model(out/draft, "CPU"))`` runs EAGLE-3 with no
    further step. Everything GenAI could not run is refused before anything is written."""
    ov, ops = openvino_modules()
    if weights not in OV_WEIGHTS:
        raise ValueError(f"unknown OpenVINO weights {weights!r}; use one of {', '.join(OV_WEIGHTS)}")
    out = Path(out)
    loaded = load_model(model, "float32", "cpu")
    cfg = loaded.model.config
    head, path, layers = None, drafter_for(model, drafter, with_drafter), []
    if path is not None:
        head = load_drafter(path, loaded.model, convention=convention)
        check_genai_variant(head, str(path))
        layers = genai_layers(head)
    w = target_weights(loaded, weights)
    ours = loaded.model.state_dict()
    error = max((float(np.abs(b.dequantized() - ours[k].numpy()).max()) for k, b in w.items()
                 if isinstance(b, Blocks)), default=0.0)
    target_dir = out / "target"
    target_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(build_target(ops, cfg, w), str(target_dir / "openvino_model.xml"), compress_to_fp16=False)
    shutil.copy(loaded.model_dir / "config.json", target_dir / "config.json")
    eos = sorted(loaded.tokenizer.eos_token_ids)
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    (target_dir / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    write_tokenizer(loaded, target_dir)
    draft_dir = None
    if head is not None and path is not None:
        draft_dir = out / "draft"
        draft_dir.mkdir(parents=True, exist_ok=True)
        m = build_draft(ops, head, w["embed_tokens.weight"])
        m.set_rt_info("True", ["eagle3_mode"])
        m.set_rt_info(" ".join(map(str, layers)), ["hidden_layers_list"])  # whitespace-separated: GenAI's reader
        ov.save_model(m, str(draft_dir / "openvino_model.xml"), compress_to_fp16=False)
        shutil.copy(Path(path) / "config.json", draft_dir / "config.json")
        (draft_dir / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
        for name in TOKENIZER_FILES:  # GenAI reads the target's; a copy keeps the draft directory whole
            shutil.copy(target_dir / name, draft_dir / name)
    info = OpenVINOExport(target_dir, draft_dir, layers, weights, error)
    (out / "export.json").write_text(json.dumps(info.to_dict() | {"version": OV_EXPORT_VERSION}, indent=1) + "\n")
    return info


def cached_export(model_source: Path, drafter: str | Path | None, with_drafter: bool,
                  weights: str = "gguf") -> OpenVINOExport:
    """The export of this target (and drafter) under ``$SPECDECODE_CACHE/exports``, made once. Its name is a digest
    of the target, the drafter's files, this module's code and OpenVINO's version, so any change makes a new one."""
    ov, _ = openvino_modules()
    path = drafter_for(str(model_source), drafter, with_drafter)
    model_key = file_fingerprint(model_source) if model_source.is_file() else dir_digest(model_source)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    h = hashlib.sha256(f"{weights}|{model_key}|{code}|{ov.__version__}".encode())
    if path is not None:
        h.update(dir_digest(path).encode())
    out = cache_root() / "exports" / f"openvino-{h.hexdigest()[:12]}"
    if not (out / "export.json").exists():
        tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")  # a run stopped halfway leaves no export behind
        shutil.rmtree(tmp, ignore_errors=True)
        export_openvino(str(model_source), path, tmp, weights, with_drafter=path is not None)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same export first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return OpenVINOExport.read(out)
