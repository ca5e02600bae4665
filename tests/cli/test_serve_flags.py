"""`serve`'s flags are checked before any model loads, each refusal naming the one flag at fault."""

import pytest

from specdecode.cli.main import build_parser
from specdecode.cli.serve import serve_config


@pytest.mark.parametrize("flag,value,words", [
    ("--max-queued", "-1", "--max-queued must be >= 0, got -1"),
    ("--max-body-bytes", "0", "--max-body-bytes must be >= 1, got 0"),
    ("--max-running-requests", "0", "--max-running-requests must be >= 1, got 0"),
    ("--port", "70000", "--port must be in [0, 65535], got 70000"),
    ("--prefix-cache-tokens", "8", "--prefix-cache-tokens must be 0 (off) or at least one block of 16 tokens, got 8"),
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


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_drafter_dir_without_a_drafter_and_bad_sampling_are_refused_before_loading(tmp_path, command):
    from specdecode.cli.common import decoder_spec
    from specdecode.io.errors import DrafterMismatchError

    prompt = ["hi"] if command == "generate" else []
    empty = build_parser().parse_args([command, "--drafter", str(tmp_path), *prompt])
    with pytest.raises(DrafterMismatchError, match=r"holds no drafter \(no config.json and no \*.safetensors\)"):
        decoder_spec(empty)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    with pytest.raises(DrafterMismatchError, match=r"holds no drafter \(no \*.safetensors\)"):
        decoder_spec(empty)
    if command == "generate":
        hot = build_parser().parse_args([command, "--temperature", "-1", *prompt])
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            decoder_spec(hot)


def test_batch_invariant_decodes_one_way_at_every_batch_size():
    parse = build_parser().parse_args
    batch = serve_config(parse(["serve", "--batch-invariant"])).batch
    assert batch.batch_invariant and batch.spec_policy == "never"  # auto would switch with the batch size
    assert serve_config(parse(["serve", "--batch-invariant", "--spec-policy", "always"])).batch.spec_policy == "always"
    assert not serve_config(parse(["serve"])).batch.batch_invariant
    with pytest.raises(ValueError, match="batch-invariant engine decodes every batch size one way.*'adaptive'"):
        serve_config(parse(["serve", "--batch-invariant", "--spec-policy", "adaptive"]))


def test_prefix_cache_tokens_reach_the_batch_config():
    parse = build_parser().parse_args
    assert serve_config(parse(["serve"])).batch.prefix_cache is None  # the engine's default: half the pool
    assert serve_config(parse(["serve", "--prefix-cache-tokens", "0"])).batch.prefix_cache == 0
    assert serve_config(parse(["serve", "--prefix-cache-tokens", "4096"])).batch.prefix_cache == 4096
