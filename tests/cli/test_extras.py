"""A missing optional extra is a clear error naming the install command, before any model loads."""

import importlib.util

from specdecode.cli.main import main


def test_serve_without_the_serving_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--port", "0"]) == 2
    assert "pip install 'specdecode[serve]'" in capsys.readouterr().err
