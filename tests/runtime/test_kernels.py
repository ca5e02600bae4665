"""runtime.kernels: a plan is measured once per machine, cached, reused, and re-measured when
the cache is unusable; static mode and non-CPU devices measure nothing."""

import json

import pytest
import torch

from specdecode.runtime.kernels import hardware_key, install_kernels, plan_path
from tests.helpers import tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    return tmp_path


def test_measured_once_then_cached(cache):
    # float32: several kernels per layer on every CPU (bf16 has only aten where oneDNN lacks bf16)
    model = tiny_model(dtype=torch.float32)
    logs = []
    first = install_kernels(model, "auto", 2, torch.device("cpu"), log=logs.append)
    assert first.source == "measured" and first.choices and "cached in" in logs[0]
    path = plan_path(hardware_key(model, 2))
    assert path.exists() and json.loads(path.read_text())["key"]["threads"] == 2
    again = install_kernels(tiny_model(dtype=torch.float32), "auto", 2, torch.device("cpu"))
    assert again.source == "cached" and again.choices == first.choices and again.seconds == 0
    assert plan_path(hardware_key(model, 1)) != path  # another thread count measures anew
    assert first.summary() == {"mode": "auto", "source": "measured", "choices": first.choices}


def test_an_unusable_cache_is_measured_again(cache):
    model = tiny_model(dtype=torch.float32)
    path = plan_path(hardware_key(model, 2))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choices": {k: ["nope"] for k in ("linear:97x64:float32",)}}))
    logs = []
    plan = install_kernels(model, "auto", 2, torch.device("cpu"), log=logs.append)
    assert plan.source == "measured" and "measuring again" in logs[0]
    assert json.loads(path.read_text())["choices"] == plan.choices


def test_static_and_unknown_modes(cache):
    model = tiny_model(dtype=torch.bfloat16)
    plan = install_kernels(model, "static", 2, torch.device("cpu"))
    assert plan.source == "static" and plan.choices == {} and not any(cache.iterdir())
    with pytest.raises(ValueError, match="use one of auto, static"):
        install_kernels(model, "fast", 2, torch.device("cpu"))


def test_fp32_copies_are_offered_only_where_they_fit(cache, monkeypatch):
    """bf16 where oneDNN has no bf16: the plan may keep fp32 copies of the weights (``onednn_f32``), unless
    they would take more than a quarter of the memory available; the choice is part of the plan's key."""
    import specdecode.core.kernels as kernels
    from specdecode.runtime import kernels as runtime_kernels

    monkeypatch.setattr(kernels, "_onednn_bf16", lambda: False)
    model = tiny_model(dtype=torch.bfloat16)
    need = runtime_kernels.f32_copy_bytes(model)
    weights = sum(g[0].packable_weight().numel() * len(g) for g in kernels.kernel_layers(model).values())
    assert need == 4 * weights
    assert runtime_kernels.excluded_kernels(model, available=4 * need) == frozenset()
    assert runtime_kernels.excluded_kernels(model, available=need) == {"onednn_f32"}
    assert hardware_key(model, 2) != hardware_key(model, 2, frozenset({"onednn_f32"}))
    monkeypatch.setattr(runtime_kernels, "available_memory", lambda: need)  # too little: not offered, logged
    logs = []
    plan = install_kernels(model, "auto", 2, torch.device("cpu"), log=logs.append)
    assert "no fp32 weight copies" in logs[0]
    assert all("onednn_f32" not in picked for picked in plan.choices.values())
    assert all(layer.packed is None for g in kernels.kernel_layers(model).values() for layer in g)
