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
    from specdecode.core.quant import Int4Linear, Int8Linear, detect_format
    from specdecode.runtime.session import RuntimeConfig, start

    ref = start(RuntimeConfig(dtype="float32", kernels="static")).loaded.model
    q4 = start(RuntimeConfig(dtype="float32", weights="q4", kernels="static")).loaded.model
    assert detect_format(q4) == "q4" and isinstance(q4.lm_head, Int8Linear)  # the Q8_0 lm_head: int8
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


def test_a_gguf_is_parsed_once_per_process_until_it_changes(tmp_path):
    """open_gguf keeps the parsed reader (a start asks for the header up to three times; gguf's
    parse of SmolLM2's vocabulary takes seconds); a rewritten file is parsed again."""
    import os

    import gguf

    from specdecode.io.gguf import open_gguf

    def write(path, value):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("test.value", value)
        w.add_tensor("blk.0.x.weight", np.zeros((2, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    path = tmp_path / "t.gguf"
    write(path, 1)
    first = open_gguf(path)
    assert open_gguf(path) is first and first.fields["test.value"].contents() == 1
    write(path, 2)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a clock that did not tick
    again = open_gguf(path)
    assert again is not first and again.fields["test.value"].contents() == 2


def test_the_tensor_index_is_kept_on_disk_and_follows_the_file(tmp_path, monkeypatch):
    """gguf_index parses a GGUF once and keeps its scalars and tensor table in the cache: a later
    start reads the index without gguf's reader, and its tensor bytes are the reader's."""
    import gguf

    import specdecode.io.gguf as io_gguf

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"

    def write(rows):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("llama.attention.head_count", 4)
        w.add_token_list(["a", "b"])  # an array: not in the index
        w.add_tensor("blk.0.attn_q.weight", np.arange(rows * 32, dtype=np.float32).reshape(rows, 32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(2)
    first = io_gguf.gguf_index(path)
    assert first.field("llama.attention.head_count") == 4 and "tokenizer.ggml.tokens" not in first.fields
    t = first.tensors["blk.0.attn_q.weight"]
    assert (t.kind, t.shape) == ("F32", (32, 2))
    np.testing.assert_array_equal(first.raw(t.name).view(np.float32), np.arange(64, dtype=np.float32))

    def no_parse(_path):
        raise AssertionError("parsed again")

    monkeypatch.setattr(io_gguf, "open_gguf", no_parse)
    assert io_gguf.gguf_index(path) == first  # from the index file
    write(3)  # another size: another fingerprint
    with pytest.raises(AssertionError, match="parsed again"):
        io_gguf.gguf_index(path)
