"""EAGLE-3 drafter checkpoints in the format SGLang, vLLM and SpecForge read: config.json
(``LlamaForCausalLMEagle3``) + safetensors (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``). Reading validates every shape and the vocabulary mapping against the target and
settles how explicit aux-layer ids are meant.

Aux-layer ids. We tap the hidden state *entering* target layer j (``hidden_layers`` in
``Transformer.forward``); the EAGLE-3 default is j in {2, N//2, N-3}. Checkpoints may
list ids explicitly in ``eagle_config.eagle_aux_hidden_state_layer_ids``, and the two
engines read them differently: SGLang treats id i as the *output* of layer i (it taps
the input of layer i+1), vLLM as the *input* of layer i. A silent off-by-one costs all
acceptance, so we write our convention into the file and warn loudly when a file does
not say which it uses.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor

from specdecode.core.drafter import DrafterConfig, Eagle3Drafter, default_aux_layer_ids
from specdecode.core.model import ModelConfig, RMSNorm, Transformer
from specdecode.io.errors import DrafterMismatchError
from specdecode.io.hf import read_config_json, read_safetensors
from specdecode.io.paths import share_readable

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
Convention = Literal["sglang", "vllm"]
CONVENTION_KEY = "specdecode_aux_layer_id_convention"  # our marker inside eagle_config


AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def config_to_hf(config: DrafterConfig) -> dict[str, Any]:
    """config.json. Aux ids are written where each engine reads them: under ``eagle_config`` in
    SGLang's convention (id = output of layer id; SGLang and SpecForge read only there, adding 1),
    with the convention recorded beside them, and at the top level in vLLM's (id = input of layer
    id; vLLM reads the top level first). Both name the same layers, so one file wires every engine
    alike: there is no per-engine variant to write (an ``eagle_config`` in vLLM's numbering made
    SGLang tap every layer one later, silently: issue 26)."""
    c = config.layer
    convention: Convention = "sglang"
    ids = [i - 1 for i in config.aux_layer_ids]
    return {AUX_IDS_KEY: list(config.aux_layer_ids)} | {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {
            AUX_IDS_KEY: ids,
            "use_aux_hidden_state": True,
            CONVENTION_KEY: convention,
        },
    }


SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
Layout = Literal["sglang", "speculators"]


def layout_for(config: DrafterConfig) -> Layout:
    """The layout a drafter is written in: SGLang's (every engine reads it) for EAGLE-3 as published;
    vLLM's speculators layout for a variant (``DrafterConfig.variant``), which names each flag where
    vLLM and speculators read it. SGLang's layout has no key for post-norm feedback, and a variant
    written there would run as plain EAGLE-3 in an engine that ignores the key, silently."""
    return "speculators" if config.variant else "sglang"


def config_to_speculators(config: DrafterConfig, verifier: str, draft_tokens: int = 3) -> dict[str, Any]:
    """config.json in vLLM's speculators layout (``speculators_model_type: eagle3``): the layer's sizes
    under ``transformer_layer_config``, the variant flags and the aux ids at the top level (the ids
    in vLLM's numbering: id = input of layer id), ``speculators_config`` naming the verifier."""
    c = config.layer
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.7.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        AUX_IDS_KEY: list(config.aux_layer_ids),
        "fc_norm": config.fc_norm,
        "norm_before_fc": config.norm_before_fc,
        "norm_before_residual": config.norm_before_residual,
        "norm_output": config.feed_normed,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
    }


def is_speculators(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg or "transformer_layer_config" in cfg


def check_architecture(cfg: dict[str, Any], source: str) -> None:
    """An EAGLE-3 drafter's config.json names its architecture; anything else is refused, saying what it is."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if "Eagle3" not in str(arch):
        raise DrafterMismatchError(
            f"{source}: architectures is {cfg.get('architectures')!r}; an EAGLE-3 drafter has "
            f"{ARCHITECTURE!r} (EAGLE-1/2 drafters are a different format)")


def config_from_hf(cfg: dict[str, Any], target: ModelConfig, source: str = "config.json",
                   convention: Convention | None = None) -> DrafterConfig:
    """A drafter's config.json in either layout (SGLang/SpecForge's or vLLM's speculators) -> its config,
    the aux ids resolved to the target layers they tap and every variant flag read where that layout
    keeps it; what this engine cannot run is refused, saying what it is."""
    check_architecture(cfg, source)
    speculators = is_speculators(cfg)
    if speculators:  # vLLM's layout: the ids at the top level, in vLLM's numbering
        layer_cfg = _speculators_layer(cfg, source)
        ids = cfg.get(AUX_IDS_KEY)
        aux = (resolve_aux_layer_ids({AUX_IDS_KEY: ids, CONVENTION_KEY: "vllm"}, target, source, None) if ids
               else default_aux_layer_ids(target))
    else:
        if cfg.get("norm_output", True) is False:
            raise DrafterMismatchError(
                f"{source}: norm_output=False: a SpecForge head without the final norm before its lm_head; this "
                "engine applies that norm (it would decode wrongly): train with the norm, or use SpecForge's engine")
        layer_cfg = cfg
        aux = resolve_all_aux_ids(cfg, target, source, convention)
    layer = _layer_config(layer_cfg, target, source)
    flags = {k: bool(cfg.get(k)) for k in ("fc_norm", "norm_before_fc", "norm_before_residual")}
    # speculators' norm_output is post-norm feedback (EAGLE-3.1); SpecForge's is the final norm, checked above
    flags["feed_normed"] = speculators and bool(cfg.get("norm_output"))
    return _drafter_config(layer, int(cfg.get("draft_vocab_size") or layer.vocab_size),
                           int(cfg.get("target_hidden_size") or layer.hidden_size), aux, flags, source)


def _speculators_layer(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The layer's config in vLLM's speculators layout (RedHat's checkpoints), refused where this engine
    cannot run it or where engines would read the file differently."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise DrafterMismatchError(f"{source}: speculators_model_type is {kind!r}; this engine runs 'eagle3'")
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise DrafterMismatchError(f"{source}: a speculators checkpoint without a transformer_layer_config "
                                   "object (the draft layer's sizes): the file is incomplete")
    if layer_cfg.get("model_type", "llama") != "llama":
        raise DrafterMismatchError(
            f"{source}: the draft layer is a {layer_cfg.get('model_type')!r} layer; this engine runs a Llama layer "
            "(a Qwen3-style layer adds q/k norms it does not compute): serve this drafter with vLLM")
    if "norm_before_residual" not in cfg:
        raise DrafterMismatchError(
            f"{source}: norm_before_residual is absent: vLLM reads that as true, speculators as false, and the two "
            "compute different heads; add \"norm_before_residual\": true or false to config.json, as trained")
    return layer_cfg


def _drafter_config(layer: ModelConfig, draft_vocab: int, target_hidden: int, aux: tuple[int, ...],
                    flags: dict[str, bool], source: str) -> DrafterConfig:
    try:
        return DrafterConfig(layer, draft_vocab, target_hidden, aux, **flags)
    except ValueError as e:
        raise DrafterMismatchError(f"{source}: {e}") from None


def _layer_config(cfg: dict[str, Any], target: ModelConfig, source: str) -> ModelConfig:
    """The one decoder layer's sizes from a config dict (the top level, or speculators' layer config)."""
    layers = int(cfg.get("num_hidden_layers") or 1)
    if layers != 1:
        raise DrafterMismatchError(f"{source}: num_hidden_layers is {layers}; this engine runs the one-layer "
                                   "EAGLE-3 head (multi-layer drafters are not supported)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        return ModelConfig(
            vocab_size=int(cfg.get("vocab_size", target.vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=1,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=cfg.get("head_dim") or hidden // heads,
            rope_theta=float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=(rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", target.max_position_embeddings)),
        )
    except KeyError as e:
        raise DrafterMismatchError(f"{source}: missing required field {e.args[0]!r}") from None


def resolve_all_aux_ids(cfg: dict[str, Any], target: ModelConfig, source: str,
                        convention: Convention | None) -> tuple[int, ...]:
    """The taps a config.json names, wherever it names them: ``eagle_config`` (SGLang's place,
    read in the recorded or given convention) and the top level (vLLM's place, so vLLM's
    convention: id = input of layer id). Both present must name the same layers: a file wired
    two ways is wrong for one engine."""
    nested = cfg.get("eagle_config") or {}
    top = cfg.get(AUX_IDS_KEY)
    if not top:
        return resolve_aux_layer_ids(nested, target, source, convention)
    top_taps = resolve_aux_layer_ids({AUX_IDS_KEY: top, CONVENTION_KEY: "vllm"}, target, source, None)
    if not nested.get(AUX_IDS_KEY):
        return top_taps
    taps = resolve_aux_layer_ids(nested, target, source, convention)
    if taps != top_taps:
        raise DrafterMismatchError(
            f"{source}: the top-level {AUX_IDS_KEY} {list(top)} (read by vLLM as layer inputs) tap layers "
            f"{list(top_taps)}, but eagle_config's tap {list(taps)}: fix the file so that both name the same layers")
    return taps


def resolve_aux_layer_ids(eagle_config: dict[str, Any], target: ModelConfig, source: str,
                          convention: Convention | None) -> tuple[int, ...]:
    """Explicit ids -> the target layers whose *input* we tap (see module docstring)."""
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layer_ids(target)
    recorded = eagle_config.get(CONVENTION_KEY)
    if convention is None:
        convention = recorded
    if convention is None:
        convention = "sglang"
        taps = tuple(int(i) + 1 for i in ids)
        log.warning(
            "%s lists eagle_aux_hidden_state_layer_ids=%s without saying how to read them. Assuming "
            "SGLang's convention (id i = output of layer i), i.e. taps entering target layers %s. "
            "vLLM reads the same ids as layer inputs (taps entering %s): if this drafter was trained "
            "that way, pass --aux-layer-convention vllm, or acceptance will collapse.",
            source, list(ids), list(taps), list(ids))
    elif convention not in ("sglang", "vllm"):
        raise DrafterMismatchError(f"{source}: unknown aux layer id convention {convention!r} (sglang | vllm)")
    taps = tuple(int(i) + (1 if convention == "sglang" else 0) for i in ids)
    bad = [t for t in taps if not 0 <= t <= target.num_layers]
    if bad:
        raise DrafterMismatchError(
            f"{source}: aux layer ids {list(ids)} ({convention} convention) tap layers {list(taps)}, "
            f"but the target has {target.num_layers} layers: this drafter belongs to another model")
    return taps


def checkpoint_state(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    c = drafter.config.layer
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    m = drafter.midlayer
    wq, wk, wv = torch.split(m.self_attn.qkv_proj.weight, [q, kv, kv])
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
    } | _variant_state(drafter)


def _variant_state(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """The tensors a variant adds, under the names SpecForge and speculators give them."""
    state: dict[str, Tensor] = {}
    if drafter.fc_norm is not None:
        state |= {f"fc_norm.{i}.weight": cast(RMSNorm, n).weight for i, n in enumerate(drafter.fc_norm)}
    if drafter.input_norm is not None:
        state["input_norm.weight"] = drafter.input_norm.weight
    return state


def save_drafter(drafter: Eagle3Drafter, path: str | Path, dtype: torch.dtype | None = None,
                 extra_config: dict[str, Any] | None = None, layout: Layout | None = None,
                 verifier: str = "unknown") -> None:
    """config.json + model.safetensors in ``layout`` (default: ``layout_for`` the drafter); ``verifier``
    names the target in the speculators layout (vLLM requires the field)."""
    from safetensors.torch import save_file

    path = Path(path)
    layout = layout or layout_for(drafter.config)
    if layout == "sglang" and drafter.config.variant:
        raise DrafterMismatchError(
            f"this drafter is a variant ({', '.join(drafter.config.variant)}) that SGLang's layout cannot say; "
            "write it in the speculators layout (export --format speculators), which vLLM reads")
    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Tensor] = {}
    for k, v in checkpoint_state(drafter).items():
        if layout == "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k.removeprefix("midlayer.")
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    share_readable(path / "model.safetensors")
    cfg = config_to_hf(drafter.config) if layout == "sglang" else config_to_speculators(drafter.config, verifier)
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
    if c.hidden_size != target.hidden_size:
        raise DrafterMismatchError(
            f"{source}: the drafter's layer is {c.hidden_size} wide, the target {target.hidden_size}: this engine "
            "feeds the layer the target's token embedding, so it runs heads as wide as their target only (a "
            "narrower head with its own embedding is not supported)")
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
    if config.fc_norm:
        expected |= {f"fc_norm.{i}.weight": (target.hidden_size,) for i in range(n_aux)}
    if config.norm_before_fc:
        expected["input_norm.weight"] = (n_aux * target.hidden_size,)
    missing = [k for k in expected if k not in state]
    if missing:
        raise DrafterMismatchError(f"{source}: missing tensors {missing} (is this an EAGLE-3 checkpoint?)")
    unknown = sorted(k for k in state if k not in expected)
    if unknown:  # a tensor this head has no place for changes what the checkpoint computes: refuse, never drop
        raise DrafterMismatchError(f"{source}: tensors this EAGLE-3 head does not have: {unknown[:8]}"
                                   f"{' ...' if len(unknown) > 8 else ''} (a variant this engine does not run, e.g. "
                                   "a second decoder layer, or a norm its config.json does not switch on)")
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


EMBEDDING_TOLERANCE = 0.25  # relative RMS difference: a 4-bit target's dequantized table is within ~0.1 of bf16


def check_embedding(embedding: Tensor | None, target: Transformer, source: str) -> None:
    """A checkpoint may carry the embedding (speculators saves the target's, frozen): this engine feeds
    the draft layer the target's own, so one that differs (a head trained with its own, or for another
    model) is refused instead of drafting from the wrong table."""
    if embedding is None:
        return
    own = target.embed_tokens.weight
    if tuple(embedding.shape) != tuple(own.shape):
        raise DrafterMismatchError(
            f"{source}: embed_tokens.weight has shape {tuple(embedding.shape)}, the target's embedding "
            f"{tuple(own.shape)}: this head has its own embedding (or belongs to another model); this engine "
            "runs heads that share their target's")
    a, b = embedding.detach().float().cpu(), own.detach().float().cpu()
    diff = float((a - b).norm() / b.norm().clamp_min(1e-12))
    if diff > EMBEDDING_TOLERANCE:
        raise DrafterMismatchError(
            f"{source}: embed_tokens.weight differs from the target's embedding (relative RMS difference "
            f"{diff:.2f}, more than rounding's {EMBEDDING_TOLERANCE}): the head was trained with its own "
            "embedding (embed_requires_grad) or for another model; this engine feeds it the target's, which "
            "would draft wrongly. Retrain with the embedding frozen, or serve it with vLLM")


def check_drafter_dir(path: str | Path) -> Path:
    """A drafter directory holds config.json and *.safetensors; refused otherwise, before anything
    loads (a command checks its --drafter before the target model, seconds earlier)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: drafter directory not found (expected config.json + *.safetensors)")
    if (path / "config.json").is_file():  # what it is, when it says: the most telling refusal first
        cfg = read_config_json(path, DrafterMismatchError, "an EAGLE-3 drafter")
        check_architecture(cfg, str(path / "config.json"))
    missing = [what for what, ok in (("config.json", (path / "config.json").is_file()),
                                     ("*.safetensors", any(path.glob("*.safetensors")))) if not ok]
    if missing:
        raise DrafterMismatchError(f"{path}: holds no drafter (no {' and no '.join(missing)}); pass the directory "
                                   "that `specdecode train` or `export` wrote, or an SGLang/vLLM/SpecForge EAGLE-3 "
                                   "checkpoint")
    return path


def read_drafter(path: str | Path, target: ModelConfig, convention: Convention | None = None,
                 ) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """A drafter directory's config and tensors (our names), checked against the target's config: every
    check but the embedding's, which needs the target's weights (``check_embedding``)."""
    path = check_drafter_dir(path)
    cfg = read_config_json(path, DrafterMismatchError, "an EAGLE-3 drafter")
    config = config_from_hf(cfg, target, str(path / "config.json"), convention)
    state = {_normalize_key(k): v for k, v in read_safetensors(path, DrafterMismatchError).items()}
    if "d2t" not in state and "t2d" not in state and config.draft_vocab_size == target.vocab_size:
        # speculators leaves both out when the draft vocabulary is the target's
        state |= {"d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
                  "t2d": torch.ones(target.vocab_size, dtype=torch.bool)}
    embedding = state.pop("embed_tokens.weight", None)
    validate_state(state, config, target, str(path))
    if embedding is not None:
        state["embed_tokens.weight"] = embedding
    return config, state


def load_drafter(path: str | Path, target: Transformer, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, convention: Convention | None = None) -> Eagle3Drafter:
    config, state = read_drafter(path, target.config, convention)
    check_embedding(state.pop("embed_tokens.weight", None), target, str(path))

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
    } | {k: v for k, v in state.items() if k.startswith(("fc_norm.", "input_norm."))}
    drafter = Eagle3Drafter(config, target.embed_tokens)
    drafter.load_state_dict(fused, strict=True)
    return drafter.to(device=device or target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)


# ---------------------------------------------------------------- acceptance table

ACCEPTANCE_FILE = "acceptance.json"  # beside a drafter's config.json: what --spec-config auto reads
ACCEPTANCE_FORMAT = "specdecode-acceptance-v1"


def read_acceptance(drafter_dir: str | Path) -> dict[str, Any] | None:
    """A drafter's acceptance table (``eval-drafter --acceptance-table``), or None if it has none.
    ``per_position_accept`` maps top-k to the share of cycles reaching each draft position."""
    path = Path(drafter_dir) / ACCEPTANCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != ACCEPTANCE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {ACCEPTANCE_FORMAT!r}")
        table = {int(k): [float(x) for x in v] for k, v in data["per_position_accept"].items()}
        if any(not all(0.0 <= x <= 1.0 for x in v) for v in table.values()):
            raise ValueError("per-position acceptance outside [0, 1]")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DrafterMismatchError(f"{path}: not a usable acceptance table ({e}); rebuild it with "
                                   f"`specdecode eval-drafter --acceptance-table` or delete it") from None
    return data | {"per_position_accept": table}


def write_acceptance(drafter_dir: str | Path, per_position: dict[int, list[float]], measured: dict[str, Any]) -> Path:
    path = Path(drafter_dir) / ACCEPTANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": ACCEPTANCE_FORMAT,
            "per_position_accept": {str(k): [round(x, 4) for x in v] for k, v in sorted(per_position.items())},
            "measured": measured}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
