"""When steps run compiled (``runtime.compiling``), the flag as every command parses it, the bench
method's ``compile=``, and the GPU check's refusal where there is no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode.bench.methods import build_method
from specdecode.cli.common import runtime_config
from specdecode.cli.main import build_parser
from specdecode.io.loading import LoadedModel
from specdecode.runtime.compiling import resolve_compile
from specdecode.runtime.session import RuntimeConfig, Session
from tests.core.test_batching import Tok
from tests.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_session():
    model = tiny_model(seed=2, dtype=torch.float32)
    loaded = LoadedModel(model, Tok(), Path("tiny"), Path("tiny"))  # type: ignore[arg-type]
    return Session(RuntimeConfig(dtype="float32", weights="native"), loaded, torch.device("cpu"), torch.float32, 1)


def test_auto_compiles_long_running_jobs_only():
    assert resolve_compile("auto", True, 1)[0] is True
    on, why = resolve_compile("auto", False, 1)
    assert on is False and "stays eager" in why
    assert resolve_compile("on", False, 1) == (True, "on: as asked")
    assert resolve_compile("off", True, 1) == (False, "off: as asked")
    assert resolve_compile("auto", True, 2) == (False, "eager: tensor parallelism (2 ranks)")
    with pytest.raises(ValueError, match="tensor parallelism is not supported"):
        resolve_compile("on", True, 2)
    with pytest.raises(ValueError, match="use one of auto, on, off"):
        resolve_compile("yes", True, 1)


@pytest.mark.parametrize("argv, long_running", [(["serve"], True), (["data", "build", "--out", "o", "--prompts", "p"],
                                                                     True),
                                                 (["generate", "hi"], False), (["bench"], False), (["sweep"], False)])
def test_every_command_parses_the_flag(argv, long_running):
    config = runtime_config(build_parser().parse_args(argv))
    assert (config.compile, config.long_running) == ("auto", long_running)
    assert runtime_config(build_parser().parse_args([*argv, "--compile", "on"])).compile == "on"


def test_bench_method_compile_parameter_is_checked(tiny_session):
    with pytest.raises(ValueError, match="compile must be on or off"):
        build_method("baseline:compile=maybe", tiny_session)
    with pytest.raises(ValueError, match="takes no parameters but compile"):
        build_method("baseline:steps=2", tiny_session)
    eager = build_method("baseline:compile=off", tiny_session)
    compiled = build_method("baseline:compile=on", tiny_session)
    assert eager.steps is None and compiled.steps is tiny_session.compiled is not None
    assert tiny_session.loaded.model.steps is None  # made for the method, not installed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
def test_gpu_check_refuses_without_cuda():
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHON": sys.executable})
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr
