"""The public API: every exported name resolves to the module that defines it, lazily."""

import subprocess
import sys

import pytest

import specdecode


def test_every_export_resolves():
    for name in specdecode.__all__:
        assert getattr(specdecode, name) is not None, name
    assert specdecode.SpecConfig is __import__("specdecode.core.speculative", fromlist=["SpecConfig"]).SpecConfig
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = specdecode.nope


def test_import_is_cheap():
    code = "import sys, specdecode; print(specdecode.__version__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [specdecode.__version__, "False"]
