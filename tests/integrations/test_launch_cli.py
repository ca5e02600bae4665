"""`specdecode launch` flags: the speculative defaults are SpecConfig's; a 0 is refused, not replaced."""

import pytest

from specdecode.cli.common import spec_config
from specdecode.cli.main import build_parser
from specdecode.core.speculative import SpecConfig


def launch_args(*argv):
    return build_parser().parse_args(["launch", "sglang", "--dry-run", *argv])


def test_defaults_come_from_spec_config():
    spec = spec_config(launch_args())
    assert spec.num_steps == SpecConfig().num_steps and spec.topk == 1  # a chain: what vLLM can draft
    assert spec == SpecConfig(SpecConfig().num_steps, 1)


@pytest.mark.parametrize("flag", ["--num-steps", "--topk", "--num-draft-tokens"])
def test_zero_is_refused(flag):
    with pytest.raises(ValueError):
        spec_config(launch_args(flag, "0"))
