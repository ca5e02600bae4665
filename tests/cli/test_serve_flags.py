"""`serve`'s flags are checked before any model loads, each refusal naming the one flag at fault."""

import pytest

from specdecode.cli.main import build_parser
from specdecode.cli.serve import serve_config


@pytest.mark.parametrize("flag,value,words", [
    ("--max-queued", "-1", "--max-queued must be >= 0, got -1"),
    ("--max-body-bytes", "0", "--max-body-bytes must be >= 1, got 0"),
    ("--max-running-requests", "0", "--max-running-requests must be >= 1, got 0"),
    ("--port", "70000", "--port must be in [0, 65535], got 70000"),
])
def test_a_bad_serve_flag_is_named_alone(flag, value, words):
    args = build_parser().parse_args(["serve", flag, value])
    with pytest.raises(ValueError) as e:
        serve_config(args)
    assert str(e.value) == words


def test_dtype_help_lists_every_dtype_that_runs(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "float32 | bfloat16 | float16 | float64 | auto" in out
