"""A kernel plan being measured (minutes on a big model, once per machine) is said as it goes."""

import torch

from specdecode.core.quant import quantize_weights
from specdecode.runtime.kernels import install_kernels
from tests.helpers import tiny_model


def test_measuring_a_kernel_plan_says_so_with_progress_and_an_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    model = tiny_model(dtype=torch.bfloat16)
    quantize_weights(model, "int8")  # int8 layers have more than one kernel to choose from
    heard: list[str] = []
    plan = install_kernels(model, "auto", 1, torch.device("cpu"), heard.append)
    assert plan.source == "measured" and heard
    assert heard[0].startswith("measuring the kernel plan for this machine:") and "once (cached in" in heard[0]
    assert any("groups measured, about" in h and "s left" in h for h in heard[1:-1])
    assert heard[-1].startswith("kernels measured in")
    again: list[str] = []
    assert install_kernels(model, "auto", 1, torch.device("cpu"), again.append).source == "cached" and not again
