"""The weight-format records (``runtime.weights``): what each needs, what it refuses, what it does."""

from pathlib import Path

import pytest
import torch

from specdecode.core import quant
from specdecode.runtime.weights import FORMATS, WEIGHT_FORMATS, q4_unavailable, weight_format
from tests.helpers import tiny_model

GGUF, HF = Path("model.Q4_1.gguf"), Path("hf-model")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_every_format_the_kernels_know_has_one_record():
    assert set(WEIGHT_FORMATS) == set(quant.WEIGHT_FORMATS) == set(FORMATS)
    with pytest.raises(ValueError, match="unknown weight format 'int4'; use one of native, int8, q4"):
        weight_format("int4")


@pytest.mark.parametrize("name", ["native", "int8", "q4"])
def test_refusals_name_the_fix(name):
    fmt = weight_format(name)
    tp = fmt.refusal(GGUF, world_size=2)
    assert (tp is None) == (name == "native")  # only native weights shard
    assert tp is None or "drop one of them" in tp
    hf = fmt.refusal(HF, world_size=1)
    assert (hf is None) == (name != "q4") and (hf is None or "(use --weights int8)" in hf)
    assert fmt.refusal(GGUF, world_size=1) is None and fmt.refusal(None, world_size=1) is None


def test_int8_applies_to_every_linear_and_native_to_none():
    model = tiny_model(dtype=torch.float32)
    assert weight_format("native").apply(model, HF, torch.float32) == 0 and quant.detect_format(model) == "native"
    assert weight_format("int8").apply(model, HF, torch.float32) > 0 and quant.detect_format(model) == "int8"


def test_auto_q4_says_why_not():
    assert "not a GGUF" in q4_unavailable(HF, "bfloat16", CPU, 1)
    assert "float32 compute" in q4_unavailable(GGUF, "float32", CPU, 1)
    assert "fast on cpu only" in q4_unavailable(GGUF, "bfloat16", CUDA, 1)
    assert "tensor parallelism (2 ranks)" in q4_unavailable(GGUF, "bfloat16", CPU, 2)
