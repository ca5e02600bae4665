"""A kernel plan being measured (minutes on a big model, once per machine) is said as it goes."""

import pytest
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


def test_a_measurement_cut_short_resumes_where_it_stopped(tmp_path, monkeypatch):
    """The plan is saved group by group: after an interruption the next start measures only the rest."""
    import specdecode.core.kernels as kernels

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    model = tiny_model(dtype=torch.bfloat16)
    quantize_weights(model, "int8")
    real = kernels._time_kernels

    def interrupted(layers, candidates, x, reps):
        if list(tmp_path.rglob("*.partial.json")):
            raise KeyboardInterrupt  # cut short inside the second group, after the first was saved
        return real(layers, candidates, x, reps)

    groups = len([g for g, layers in kernels.kernel_layers(model).items()
                  if max(len(layers[0].kernel_candidates(r)) for r in kernels.ROW_BUCKETS) >= 2])
    assert groups >= 2
    monkeypatch.setattr(kernels, "_time_kernels", interrupted)
    with pytest.raises(KeyboardInterrupt):
        install_kernels(model, "auto", 1, torch.device("cpu"))
    partial = list(tmp_path.rglob("*.partial.json"))
    assert len(partial) == 1
    monkeypatch.setattr(kernels, "_time_kernels", real)
    heard: list[str] = []
    plan = install_kernels(model, "auto", 1, torch.device("cpu"), heard.append)
    assert plan.source == "measured" and any("resuming a measurement cut short (1 groups" in h for h in heard)
    assert f"{groups - 1} layer groups" in heard[1] and not list(tmp_path.rglob("*.partial.json"))
