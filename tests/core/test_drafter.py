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
    ({"fc_norm": True}, "fc_norm=True: a SpecForge variant"),
    ({"norm_before_residual": True}, "norm_before_residual=True: a SpecForge variant"),
    ({"norm_output": False}, "norm_output=False: a SpecForge head without the final norm"),
    ({"speculators_model_type": "eagle3"}, "a speculators checkpoint .* does not read this one yet"),
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
