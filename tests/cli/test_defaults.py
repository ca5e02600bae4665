"""One default speculative configuration: `generate`, `check`, `serve` and `bench --methods
eagle3` all decode with ``SpecConfig()`` unless told otherwise."""

import json
from dataclasses import asdict

import pytest

from specdecode.bench.methods import method_decoder_spec, split_methods
from specdecode.cli.common import decoder_spec
from specdecode.cli.main import build_parser, main
from specdecode.core.speculative import SpecConfig
from tests.helpers import run_specdecode


def test_every_command_parses_to_the_one_default():
    parser = build_parser()
    for argv in (["generate", "hi"], ["check"], ["serve"]):
        assert decoder_spec(parser.parse_args(argv)).config == SpecConfig(), argv
    bench = parser.parse_args(["bench", "--methods", "baseline,eagle3"])
    eagle3 = split_methods(bench.methods)[1]
    assert method_decoder_spec(eagle3, bench.drafter).config == SpecConfig()


def test_flags_override_the_default_field_by_field():
    parser = build_parser()
    chain = decoder_spec(parser.parse_args(["generate", "hi", "--num-steps", "4", "--topk", "1"])).config
    assert (chain.num_steps, chain.topk, chain.num_draft_tokens) == (4, 1, 5)
    deeper = decoder_spec(parser.parse_args(["generate", "hi", "--num-steps", "2"])).config
    assert (deeper.num_steps, deeper.topk) == (2, SpecConfig().topk)


@pytest.mark.parametrize("flag", ["--num-steps", "--topk", "--num-draft-tokens"])
def test_zero_is_refused_not_replaced_by_the_default(flag, capsys):
    assert main(["generate", "hi", flag, "0"]) == 2
    assert "must be" in capsys.readouterr().err


@pytest.mark.model
def test_generate_and_bench_measure_the_same_configuration(tmp_path):
    """End to end: the configuration generate decodes with is the one bench's `eagle3` measures."""
    gen = json.loads(run_specdecode("generate", "Hi", "--json", "--drafter", "random", "--max-new-tokens", "4",
                                    "--dtype", "bfloat16").stdout)
    out = tmp_path / "bench.json"
    run_specdecode("bench", "--methods", "baseline,eagle3", "--drafter", "random", "--num-prompts", "1",
                   "--max-new-tokens", "4", "--runs", "1", "--warmup", "0", "--dtype", "bfloat16", "--no-store",
                   "--out", str(out))
    bench = json.loads(out.read_text())
    assert gen["spec_config"] == bench["spec_configs"]["eagle3"] == asdict(SpecConfig())
