"""`specdecode launch` flags: the speculative defaults are SpecConfig's (a chain for vLLM, the only
shape it drafts); a 0 is refused, not replaced."""

import pytest

from specdecode.cli.launch import launch_spec
from specdecode.cli.main import build_parser
from specdecode.core.speculative import SpecConfig


def launch_args(engine, *argv):
    return build_parser().parse_args(["launch", engine, "--dry-run", *argv])


def test_defaults_come_from_spec_config():
    assert launch_spec(launch_args("sglang")) == SpecConfig()
    assert launch_spec(launch_args("vllm")) == SpecConfig(SpecConfig().num_steps, 1)
    assert launch_spec(launch_args("sglang", "--num-steps", "3", "--topk", "1")) == SpecConfig(3, 1)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("flag", ["--num-steps", "--topk", "--num-draft-tokens"])
def test_zero_is_refused(engine, flag):
    with pytest.raises(ValueError):
        launch_spec(launch_args(engine, flag, "0"))
