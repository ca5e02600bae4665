"""Plots are an optional extra: without matplotlib a sweep still measures and writes its JSON."""

import importlib.util

import pytest

from specdecode.bench import plots


@pytest.fixture
def no_matplotlib(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_without_matplotlib_plots_are_skipped_with_the_extra_named(no_matplotlib, tmp_path):
    assert not plots.plots_available()
    assert plots.sweep_plots({"configs": []}, tmp_path) == []
    with pytest.raises(ValueError, match=r"specdecode\[plots\]"):
        plots.pyplot()


def test_with_matplotlib_pyplot_is_headless():
    assert plots.plots_available()
    assert plots.pyplot().get_backend().lower() == "agg"
