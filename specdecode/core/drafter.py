"""EAGLE-3 draft head (the module; its checkpoint format lives in ``specdecode.io.checkpoints``).

The draft is one Llama decoder layer. Its first step fuses three target hidden states
(``fc: 3*H_target -> H``); its attention input is ``[input_layernorm(embedding),
hidden_norm(hidden)]`` (2H wide); its own ``lm_head`` covers a reduced draft vocabulary
mapped back to target ids by ``d2t`` (``target_id = i + d2t[i]``); ``t2d`` marks which
target ids are in the draft vocabulary. Later draft steps feed the draft's own output
hidden state back (H wide, no ``fc``). The token embedding is the target's, shared.
``aux_layer_ids`` are the target layers whose *input* hidden states are fused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdecode.core.model import (MLP, Attention, KVCache, Linear, ModelConfig, RMSNorm, build_attention_mask,
                    rope_cos_sin, rope_inv_freq, Transformer)

@dataclass
class DrafterConfig:
    layer: ModelConfig  # the one decoder layer (num_layers = 1), rope settings included
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose *input* hidden states are fused

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

def default_aux_layer_ids(target: ModelConfig) -> tuple[int, ...]:
    return target.eagle3_aux_layer_ids


class DraftLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        c = config.layer
        self.fc = Linear(len(config.aux_layer_ids) * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DraftLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # The target's embedding, shared (kept out of state_dict: not ours to save).
        self._embed = [embed_tokens]
        self.inv_freq = rope_inv_freq(c)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed[0]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.layer, 1, max_len, self.dtype, self.device)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One draft step for ``tokens`` [B, T] paired with ``hidden`` [B, T, 3*H_t] (fused
        target taps) or [B, T, H] (the draft's own output). Returns draft-vocab logits and
        the pre-norm output hidden state that the next step feeds back."""
        B, T = tokens.shape
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"draft cache overflow: {start + T} > {cache.max_len}")
        if positions.dim() == 1:
            positions = positions.expand(B, T)
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = torch.cat((layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)), dim=-1)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        mask = build_attention_mask(attention_mask, T, start, self.device)
        h = hidden + layer.self_attn(x, cos, sin, cache.k[0], cache.v[0], start, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        cache.length = start + T
        return self.lm_head(self.norm(h)), h


# ---------------------------------------------------------------- checkpoint I/O

def _to_checkpoint_state(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    c = drafter.config.layer
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = drafter.midlayer
    wq, wk, wv = m.self_attn.qkv_proj.weight.split((q, kv, kv))
    gate, up = m.mlp.gate_up_proj.weight.chunk(2)
    return {
        "fc.weight": drafter.fc.weight,
        "midlayer.self_attn.q_proj.weight": wq, "midlayer.self_attn.k_proj.weight": wk,
        "midlayer.self_attn.v_proj.weight": wv, "midlayer.self_attn.o_proj.weight": m.self_attn.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": m.mlp.down_proj.weight,
        "midlayer.input_layernorm.weight": m.input_layernorm.weight,
        "midlayer.hidden_norm.weight": m.hidden_norm.weight,
        "midlayer.post_attention_layernorm.weight": m.post_attention_layernorm.weight,
        "norm.weight": drafter.norm.weight, "lm_head.weight": drafter.lm_head.weight,
        "d2t": drafter.d2t, "t2d": drafter.t2d,
    }


def save_drafter(drafter: Eagle3Drafter, path: str | Path, dtype: torch.dtype | None = None,
                 convention: Convention = "sglang", extra_config: dict | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in _to_checkpoint_state(drafter).items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter.config.to_hf(convention)
    cfg["torch_dtype"] = str(dtype or drafter.dtype).removeprefix("torch.")
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _normalize_key(key: str) -> str:
    """Accept the vLLM spelling (``layers.0.*``, ``draft_id_to_target_id``, ``model.`` prefix)."""
    key = key.removeprefix("model.")
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0."):]
    if key == "draft_id_to_target_id":
        key = "d2t"
    return key


def validate_state(state: dict[str, Tensor], config: DrafterConfig, target: ModelConfig, source: str) -> None:
    """Every shape and mapping the wiring depends on; raise with the fix, never load silently."""
    c = config.layer
    if config.target_hidden_size != target.hidden_size:
        raise DrafterMismatchError(
            f"{source}: drafter expects target hidden size {config.target_hidden_size}, the target has "
            f"{target.hidden_size}: this drafter was trained for another model")
    if c.vocab_size != target.vocab_size:
        raise DrafterMismatchError(
            f"{source}: drafter vocab_size {c.vocab_size} != target vocab size {target.vocab_size}: "
            "this drafter was trained for another model/tokenizer")
    n_aux = len(config.aux_layer_ids)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    expected = {
        "fc.weight": (c.hidden_size, n_aux * target.hidden_size),
        "midlayer.self_attn.q_proj.weight": (q, 2 * c.hidden_size),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * c.hidden_size),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * c.hidden_size),
        "midlayer.self_attn.o_proj.weight": (c.hidden_size, q),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "midlayer.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "midlayer.input_layernorm.weight": (c.hidden_size,),
        "midlayer.hidden_norm.weight": (c.hidden_size,),
        "midlayer.post_attention_layernorm.weight": (c.hidden_size,),
        "norm.weight": (c.hidden_size,),
        "lm_head.weight": (config.draft_vocab_size, c.hidden_size),
        "d2t": (config.draft_vocab_size,),
        "t2d": (target.vocab_size,),
    }
    missing = [k for k in expected if k not in state]
    if missing:
        raise DrafterMismatchError(f"{source}: missing tensors {missing} (is this an EAGLE-3 checkpoint?)")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            hint = ""
            if k == "fc.weight":
                hint = (f" (fc fuses {n_aux} target hidden states of size {target.hidden_size}; "
                        "a different width means a different target model)")
            raise DrafterMismatchError(f"{source}: {k} has shape {tuple(state[k].shape)}, expected {shape}{hint}")
    for k, v in state.items():
        if k not in ("d2t", "t2d") and not v.is_floating_point():
            raise DrafterMismatchError(f"{source}: {k} has dtype {v.dtype}; weights must be floating point")
    d2t, t2d = state["d2t"], state["t2d"]
    if d2t.is_floating_point():
        raise DrafterMismatchError(f"{source}: d2t has dtype {d2t.dtype}; it must hold integer offsets")
    target_ids = torch.arange(config.draft_vocab_size) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= target.vocab_size:
        raise DrafterMismatchError(
            f"{source}: d2t maps draft ids to target ids in [{int(target_ids.min())}, {int(target_ids.max())}], "
            f"outside the target vocabulary [0, {target.vocab_size}): d2t must hold offsets (target = i + d2t[i])")
    if len(set(target_ids.tolist())) != config.draft_vocab_size:
        raise DrafterMismatchError(f"{source}: d2t maps two draft ids to the same target id")
    t2d = t2d.bool()
    if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise DrafterMismatchError(
            f"{source}: t2d marks {int(t2d.sum())} target ids but d2t maps {config.draft_vocab_size}, or they "
            "disagree: t2d must be True exactly at the target ids d2t produces")


def load_drafter(path: str | Path, target: Transformer, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, convention: Convention | None = None) -> Eagle3Drafter:
    from specdecode.io.hf import read_config_json, read_safetensors

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: drafter directory not found (expected config.json + *.safetensors)")
    cfg = read_config_json(path, DrafterMismatchError, "an EAGLE-3 drafter")
    config = DrafterConfig.from_hf(cfg, target.config, str(path / "config.json"), convention)
    state = {_normalize_key(k): v for k, v in read_safetensors(path, DrafterMismatchError).items()}
    state.pop("embed_tokens.weight", None)  # some exports include the (target's) embedding
    validate_state(state, config, target.config, str(path))

    fused = {
        "fc.weight": state["fc.weight"],
        "midlayer.self_attn.qkv_proj.weight": torch.cat([state[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"]),
        "midlayer.self_attn.o_proj.weight": state["midlayer.self_attn.o_proj.weight"],
        "midlayer.mlp.gate_up_proj.weight": torch.cat((state["midlayer.mlp.gate_proj.weight"],
                                                       state["midlayer.mlp.up_proj.weight"])),
        "midlayer.mlp.down_proj.weight": state["midlayer.mlp.down_proj.weight"],
        "midlayer.input_layernorm.weight": state["midlayer.input_layernorm.weight"],
        "midlayer.hidden_norm.weight": state["midlayer.hidden_norm.weight"],
        "midlayer.post_attention_layernorm.weight": state["midlayer.post_attention_layernorm.weight"],
        "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"],
        "d2t": state["d2t"].long(), "t2d": state["t2d"].bool(),
    }
    drafter = Eagle3Drafter(config, target.embed_tokens)
    drafter.load_state_dict(fused, strict=True)
    return drafter.to(device=device or target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)


def random_drafter(target: Transformer, draft_vocab_size: int | None = None, seed: int = 0,
                   init_std: float = 0.02) -> Eagle3Drafter:
    """An untrained drafter wired to ``target`` (tests, profiling before training).
    The draft vocabulary is the first ``draft_vocab_size`` target ids."""
    t = target.config
    vd = draft_vocab_size or t.vocab_size
    layer = ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                        num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, rms_norm_eps=t.rms_norm_eps,
                        max_position_embeddings=t.max_position_embeddings)
    config = DrafterConfig(layer, vd, t.hidden_size, default_aux_layer_ids(t))
    drafter = Eagle3Drafter(config, target.embed_tokens)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
        drafter.t2d[:vd] = True
    return drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
