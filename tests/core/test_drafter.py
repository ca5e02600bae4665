"""EAGLE-3 checkpoint format: round trip, vLLM spelling, and a clear error per wiring mismatch."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.core.drafter import random_drafter
from specdecode.core.sampling import SamplingParams
from specdecode.core.speculative import SpecConfig
from specdecode.io.checkpoints import load_drafter, save_drafter
from specdecode.io.errors import DrafterMismatchError
from tests.helpers import eagle3_steps, tiny_model

SGLANG_KEYS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d"}


@pytest.fixture
def target():
    return tiny_model(seed=0)


@pytest.fixture
def saved(tmp_path, target):
    drafter = random_drafter(target, draft_vocab_size=40, seed=1, init_std=0.3)
    # a non-trivial mapping: draft id i -> target id 2i (offset i)
    with torch.no_grad():
        drafter.d2t.copy_(torch.arange(40))
        drafter.t2d.zero_()
        drafter.t2d[torch.arange(40) * 2] = True
    save_drafter(drafter, tmp_path / "d")
    return drafter, tmp_path / "d"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_state(path, fn):
    f = path / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f))


def test_format_and_round_trip(saved, target):
    drafter, path = saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 97 and cfg["num_hidden_layers"] == 1
    # SGLang convention: ids are layer outputs, one less than the taps {2, N//2, N-3}
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    assert set(load_file(str(path / "model.safetensors"))) == SGLANG_KEYS
    loaded = load_drafter(path, target)
    assert loaded.config.aux_layer_ids == target.config.eagle3_aux_layer_ids
    a = list(eagle3_steps(target, drafter, [1, 2, 3], 20, SamplingParams(), None, SpecConfig(3, 2, 6)))
    b = list(eagle3_steps(target, loaded, [1, 2, 3], 20, SamplingParams(), None, SpecConfig(3, 2, 6)))
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.cycle.accepted for s in a[1:]] == [s.cycle.accepted for s in b[1:]]


def test_vllm_spelling_loads_the_same(saved, target):
    drafter, path = saved

    def to_vllm(state):
        for k in list(state):
            if k.startswith("midlayer."):
                state["layers.0." + k[len("midlayer."):]] = state.pop(k)
        state["draft_id_to_target_id"] = state.pop("d2t")

    edit_state(path, to_vllm)
    loaded = load_drafter(path, target)
    torch.testing.assert_close(loaded.midlayer.self_attn.qkv_proj.weight, drafter.midlayer.self_attn.qkv_proj.weight)
    assert torch.equal(loaded.d2t, drafter.d2t)


def test_other_target_hidden_size(saved):
    _, path = saved
    other = tiny_model(seed=0, hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(DrafterMismatchError, match="target hidden size 64, the target has 32"):
        load_drafter(path, other)


def test_other_vocab(saved):
    _, path = saved
    with pytest.raises(DrafterMismatchError, match="vocab_size 97 != target vocab size 120"):
        load_drafter(path, tiny_model(seed=0, vocab_size=120))


def test_aux_ids_beyond_target_layers(saved):
    _, path = saved
    edit_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 30]})
    with pytest.raises(DrafterMismatchError, match="the target has 6 layers"):
        load_drafter(path, tiny_model(seed=0))


def test_ambiguous_aux_ids_warn_loudly(saved, target, caplog):
    _, path = saved
    # a file from elsewhere: ids in eagle_config only, no convention marker
    edit_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]},
                eagle_aux_hidden_state_layer_ids=None)
    with caplog.at_level(logging.WARNING):
        d = load_drafter(path, target)
    assert "--aux-layer-convention vllm" in caplog.text
    assert d.config.aux_layer_ids == (2, 3, 3)  # SGLang reading: +1
    assert load_drafter(path, target, convention="vllm").config.aux_layer_ids == (1, 2, 2)


def test_no_aux_ids_means_defaults(saved, target):
    _, path = saved
    edit_config(path, eagle_config=None, eagle_aux_hidden_state_layer_ids=None)
    assert load_drafter(path, target).config.aux_layer_ids == (2, 3, 3)


def test_d2t_out_of_range(saved, target):
    _, path = saved
    edit_state(path, lambda s: s.__setitem__("d2t", s["d2t"] + 90))
    with pytest.raises(DrafterMismatchError, match="outside the target vocabulary"):
        load_drafter(path, target)


def test_t2d_disagrees_with_d2t(saved, target):
    _, path = saved

    def shift(s):
        t2d = torch.zeros(97, dtype=torch.bool)
        t2d[:40] = True
        s["t2d"] = t2d

    edit_state(path, shift)
    with pytest.raises(DrafterMismatchError, match="t2d must be True exactly"):
        load_drafter(path, target)


def test_missing_tensor(saved, target):
    _, path = saved
    edit_state(path, lambda s: s.pop("fc.weight"))
    with pytest.raises(DrafterMismatchError, match="missing tensors \\['fc.weight'\\]"):
        load_drafter(path, target)


def test_wrong_shape(saved, target):
    _, path = saved
    edit_state(path, lambda s: s.__setitem__("lm_head.weight", torch.zeros(30, 64)))
    with pytest.raises(DrafterMismatchError, match="lm_head.weight has shape \\(30, 64\\), expected \\(40, 64\\)"):
        load_drafter(path, target)


def test_float_d2t(saved, target):
    _, path = saved
    edit_state(path, lambda s: s.__setitem__("d2t", s["d2t"].float()))
    with pytest.raises(DrafterMismatchError, match="d2t has dtype torch.float32"):
        load_drafter(path, target)


def test_not_an_eagle3_checkpoint(saved, target):
    _, path = saved
    edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(DrafterMismatchError, match="LlamaForCausalLMEagle3"):
        load_drafter(path, target)


def test_truncated_weights(saved, target):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:500])
    with pytest.raises(DrafterMismatchError, match="truncated"):
        load_drafter(path, target)


def test_missing_directory(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="drafter directory not found"):
        load_drafter(tmp_path / "nope", target)


def test_bf16_save_is_small_and_loads(saved, target, tmp_path):
    drafter, _ = saved
    save_drafter(drafter, tmp_path / "bf16", dtype=torch.bfloat16)
    state = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert load_drafter(tmp_path / "bf16", target).dtype == torch.float64  # cast to the target's dtype


def test_ids_are_written_where_each_engine_reads_them(tmp_path, target):
    """vLLM reads eagle_aux_hidden_state_layer_ids from the top level of config.json first (as layer
    inputs); SGLang and SpecForge only from eagle_config (as layer outputs, +1). Every file names the
    same layers in both places, eagle_config always in SGLang's numbering (an eagle_config in vLLM's made
    SGLang tap every layer one later)."""
    drafter = random_drafter(target, draft_vocab_size=40, seed=1)
    taps = list(drafter.config.aux_layer_ids)
    save_drafter(drafter, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == taps  # vLLM's place and reading
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in taps]  # SGLang adds 1
    assert cfg["eagle_config"]["specdecode_aux_layer_id_convention"] == "sglang"
    assert load_drafter(tmp_path / "d", target).config.aux_layer_ids == drafter.config.aux_layer_ids


def test_top_level_aux_ids_alone_are_read_as_vllm_does(saved, target):
    _, path = saved
    edit_config(path, eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 2, 2])
    assert load_drafter(path, target).config.aux_layer_ids == (1, 2, 2)  # vLLM: id = input of layer id


def test_aux_ids_that_disagree_between_engines_are_refused(saved, target):
    _, path = saved  # eagle_config: SGLang ids [1, 2, 2], i.e. taps entering layers 2, 3, 3
    edit_config(path, eagle_aux_hidden_state_layer_ids=[1, 2, 2])  # vLLM would tap 1, 2, 2
    with pytest.raises(DrafterMismatchError, match="both name the same layers"):
        load_drafter(path, target)


@pytest.mark.parametrize("change,words", [
    ({"num_hidden_layers": 2}, "num_hidden_layers is 2; this engine runs the one-layer"),
    ({"fc_norm": True}, r"missing tensors \['fc_norm.0.weight'"),  # switched on, its weights absent
    ({"fc_norm": True, "norm_before_fc": True}, "fc_norm and norm_before_fc both normalize fc's input"),
    ({"norm_output": False}, "norm_output=False: a SpecForge head without the final norm"),
    ({"speculators_model_type": "eagle3"}, "a speculators checkpoint without a transformer_layer_config"),
    ({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "qwen3"}},
     "a 'qwen3' layer; this engine runs a Llama layer"),
    ({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"}},
     "norm_before_residual is absent: vLLM reads that as true, speculators as false"),
    ({"hidden_size": 32}, "the drafter's layer is 32 wide, the target 64"),
])
def test_a_head_variant_this_engine_does_not_run_is_refused(saved, target, change, words):
    _, path = saved
    edit_config(path, **change)
    with pytest.raises(DrafterMismatchError, match=words):
        load_drafter(path, target)


def test_a_tensor_the_head_has_no_place_for_is_refused(saved, target):
    _, path = saved
    edit_state(path, lambda s: s.__setitem__("fc_norm.weight", torch.ones(64)))
    with pytest.raises(DrafterMismatchError, match=r"does not have: \['fc_norm.weight'\]"):
        load_drafter(path, target)


# ---------------------------------------------------------------- variants and vLLM's speculators layout

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_step(d, sd, flags, tokens, hidden, positions, keys, values):
    """One draft step as speculators and vLLM compute it (their published arithmetic, written out from the
    checkpoint's tensors by name, independently of Eagle3Drafter): (logits, what the next step reads,
    this step's key and value)."""
    c, eps = d.config.layer, d.config.layer.rms_norm_eps
    if hidden.shape[-1] != c.hidden_size:
        if flags.get("norm_before_fc"):
            hidden = _rms(hidden, sd["input_norm.weight"], eps)
        if flags.get("fc_norm"):
            parts = hidden.chunk(len(d.config.aux_layer_ids), -1)
            hidden = torch.cat([_rms(p, sd[f"fc_norm.{i}.weight"], eps) for i, p in enumerate(parts)], -1)
        hidden = hidden @ sd["fc.weight"].T
    normed = _rms(hidden, sd["layers.0.hidden_norm.weight"], eps)
    x = torch.cat((_rms(d.embed_tokens.weight[tokens], sd["layers.0.input_layernorm.weight"], eps), normed), -1)
    residual = normed if flags.get("norm_before_residual") else hidden
    q = (x @ sd["layers.0.self_attn.q_proj.weight"].T).view(-1, c.num_heads, c.head_dim)
    k = (x @ sd["layers.0.self_attn.k_proj.weight"].T).view(-1, c.num_kv_heads, c.head_dim)
    v = (x @ sd["layers.0.self_attn.v_proj.weight"].T).view(-1, c.num_kv_heads, c.head_dim)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    ang = positions[:, None].double() * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]

    def rope(t):
        a, b = t.chunk(2, -1)
        return t * cos + torch.cat((-b, a), -1) * sin
    q, k = rope(q), rope(k)
    keys, values = torch.cat((keys, k)), torch.cat((values, v))
    rep = c.num_heads // c.num_kv_heads
    kk, vv = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    n, m = len(q), len(kk)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / c.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(n, -1)
    attn = attn @ sd["layers.0.self_attn.o_proj.weight"].T
    h = residual + attn
    y = _rms(h, sd["layers.0.post_attention_layernorm.weight"], eps)
    h = h + (torch.nn.functional.silu(y @ sd["layers.0.mlp.gate_proj.weight"].T)
             * (y @ sd["layers.0.mlp.up_proj.weight"].T)) @ sd["layers.0.mlp.down_proj.weight"].T
    out = _rms(h, sd["norm.weight"], eps)
    logits = out @ sd["lm_head.weight"].T
    return logits, out if flags.get("norm_output") else h, keys, values


@pytest.mark.parametrize("variant", [(), ("fc_norm", "norm_output"), ("norm_before_fc", "norm_before_residual"),
                                     ("fc_norm", "norm_before_residual", "norm_output")])
def test_each_variant_drafts_what_vllm_and_speculators_compute(tmp_path, target, variant):
    """A variant drafter written in the speculators layout, loaded back, drafts two steps (the second on
    what the first fed back) exactly as the published arithmetic computes them from the file's tensors."""
    drafter = random_drafter(target, seed=3, init_std=0.3, variant=variant)
    with torch.no_grad():  # norms away from 1, so that a norm applied in the wrong place shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    save_drafter(drafter, tmp_path / "d", verifier="tiny")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert ("speculators_model_type" in cfg) == bool(variant)  # EAGLE-3 as published stays in SGLang's layout
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.config.variant == variant
    sd = {k.replace("midlayer.", "layers.0."): v
          for k, v in load_file(str(tmp_path / "d" / "model.safetensors")).items()}
    flags = dict.fromkeys(variant, True)
    gen = torch.Generator().manual_seed(5)
    taps = torch.randn(4, 3 * 64, generator=gen, dtype=torch.float64) * 3
    tokens, pos = torch.tensor([5, 9, 2, 7]), torch.arange(4)
    cache = loaded.new_cache(16)
    logits, fed = loaded(tokens[None], taps[None], pos, cache)
    empty = torch.zeros(0, 2, 16, dtype=torch.float64)
    ref_logits, ref_fed, k, v = _reference_step(loaded, sd, flags, tokens, taps, pos, empty, empty)
    close = {"atol": 1e-5, "rtol": 1e-4}  # RoPE's angles are float32 in the engine; a misplaced norm is O(1)
    torch.testing.assert_close(logits[0], ref_logits, **close)
    torch.testing.assert_close(fed[0], ref_fed, **close)
    nxt = torch.tensor([11])
    logits2, _ = loaded(nxt[None], fed[:, -1:], torch.tensor([4]), cache)
    ref2, _, _, _ = _reference_step(loaded, sd, flags, nxt, ref_fed[-1:], torch.tensor([4]), k, v)
    torch.testing.assert_close(logits2[0], ref2, **close)


def _published_speculators_checkpoint(path, drafter, target):
    """``drafter`` written by hand the way speculators writes a checkpoint (its published layout: issue 53):
    ``layers.0.*`` names, the target's embedding included, no d2t/t2d (the draft vocabulary is the
    target's), the flags and ids at the top level, the layer under ``transformer_layer_config``."""
    from specdecode.io.checkpoints import checkpoint_state

    c = drafter.config.layer
    state = {k.replace("midlayer.", "layers.0."): v.detach().clone().contiguous()
             for k, v in checkpoint_state(drafter).items() if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": c.vocab_size, "dtype": "float64", "eagle_aux_hidden_state_layer_ids": [1, 3, 3],
        "embed_requires_grad": False, "fc_norm": drafter.config.fc_norm,
        "norm_before_fc": drafter.config.norm_before_fc, "norm_before_residual": drafter.config.norm_before_residual,
        "norm_output": drafter.config.feed_normed,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "/model"}},
        "speculators_model_type": "eagle3", "speculators_version": "0.8.0.dev0", "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {"attention_bias": False, "head_dim": c.head_dim, "hidden_act": "silu",
                                     "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                                     "max_position_embeddings": c.max_position_embeddings, "mlp_bias": False,
                                     "model_type": "llama", "num_attention_heads": c.num_heads,
                                     "num_hidden_layers": 1, "num_key_value_heads": c.num_kv_heads,
                                     "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None,
                                     "rope_theta": c.rope_theta, "vocab_size": c.vocab_size}}))


def test_a_speculators_checkpoint_in_the_published_layout_loads_and_decodes_losslessly(tmp_path, target):
    from tests.helpers import plain_steps

    made = random_drafter(target, seed=4, init_std=0.3, variant=("fc_norm", "norm_before_residual", "norm_output"))
    _published_speculators_checkpoint(tmp_path / "s", made, target)
    drafter = load_drafter(tmp_path / "s", target)
    assert drafter.config.aux_layer_ids == (1, 3, 3)  # top-level ids in vLLM's numbering: inputs of those layers
    assert drafter.config.variant == ("fc_norm", "norm_before_residual", "norm_output")
    assert bool(drafter.t2d.all()) and not bool(drafter.d2t.any())  # no d2t/t2d: the target's vocabulary
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = [t for step in plain_steps(target, prompt, 24, SamplingParams()) for t in step.tokens]
    for shape in (SpecConfig(3, 1, 4), SpecConfig(3, 2, 6)):
        spec = [t for step in eagle3_steps(target, drafter, prompt, 24, SamplingParams(), None, shape)
                for t in step.tokens]
        assert spec == plain
    # and ours written out in that layout reads back the same head
    save_drafter(drafter, tmp_path / "ours", verifier="tiny")
    again = load_drafter(tmp_path / "ours", target)
    for (k, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_an_embedding_other_than_the_targets_is_refused(tmp_path, target):
    """speculators saves the (frozen) target embedding beside the head: the same table loads; a head
    trained with its own, or built for another model, is refused rather than fed the target's."""
    made = random_drafter(target, seed=4, init_std=0.3, variant=("norm_before_residual",))
    _published_speculators_checkpoint(tmp_path / "s", made, target)
    same = target.embed_tokens.weight.detach()
    edit_state(tmp_path / "s", lambda s: s.__setitem__("embed_tokens.weight", (same * 1.02).clone()))
    load_drafter(tmp_path / "s", target)  # within rounding of the target's table: loads
    edit_state(tmp_path / "s", lambda s: s.__setitem__("embed_tokens.weight", torch.randn_like(same)))
    with pytest.raises(DrafterMismatchError, match="differs from the target's embedding"):
        load_drafter(tmp_path / "s", target)
    edit_state(tmp_path / "s", lambda s: s.__setitem__("embed_tokens.weight", torch.randn(97, 32)))
    with pytest.raises(DrafterMismatchError, match="has its own embedding"):
        load_drafter(tmp_path / "s", target)
