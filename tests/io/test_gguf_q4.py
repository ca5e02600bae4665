"""io.gguf: a GGUF's 4-bit blocks read as (q, scale, zero), equal to gguf's own dequantization,
and the q4 weight format on the default model: its layers are the file's weights."""

import numpy as np
import pytest
import torch

from specdecode.io.gguf import q4_blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_ggufs_own_dequantization(kind):
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    q, scales, zeros = q4_blocks(raw, kind, 6, 96)
    assert q.shape == (6, 96) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (6, 3)
    group = torch.arange(96) // 32
    ours = (q.float() - 8) * scales[:, group] + zeros[:, group]
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # float rounding of (q-8)*d + (m+8d) vs d*q+m


@pytest.mark.model
def test_q4_format_runs_the_files_own_weights():
    from specdecode.core.quant import Int4Linear, Int8Linear, weight_format
    from specdecode.runtime.session import RuntimeConfig, start

    ref = start(RuntimeConfig(dtype="float32", kernels="static")).loaded.model
    q4 = start(RuntimeConfig(dtype="float32", weights="q4", kernels="static")).loaded.model
    assert weight_format(q4) == "q4" and isinstance(q4.lm_head, Int8Linear)  # the Q8_0 lm_head: int8
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = q4.layers[3].get_submodule(name)
        assert isinstance(layer, Int4Linear)
        # the dequantized GGUF the native loader reads, to float rounding: no re-quantization
        torch.testing.assert_close(layer.dequantized(), ref.layers[3].get_submodule(name).weight, rtol=0, atol=1e-6)


def test_q4_needs_a_gguf(tmp_path):
    from specdecode.runtime.session import RuntimeConfig, start
    from tests.helpers import save_tiny_hf

    save_tiny_hf(tmp_path)
    with pytest.raises(ValueError, match=r"not a GGUF file \(use --weights int8\)"):
        start(RuntimeConfig(model=str(tmp_path), weights="q4"))
