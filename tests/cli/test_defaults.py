"""One default, decided in one place each: the format (``runtime.autoformat``: ``--dtype auto``,
``--weights auto``; ``check`` keeps float32) and the speculative shape (``runtime.autospec``:
``--spec-config auto``). Every command and the library get the same choice."""

import json

import pytest

from specdecode.bench.methods import method_decoder_spec, split_methods
from specdecode.cli.common import decoder_spec, runtime_config
from specdecode.cli.main import build_parser, main
from specdecode.core.costmodel import AutoSpec
from specdecode.core.speculative import SpecConfig
from specdecode.io.paths import default_drafter_path
from specdecode.runtime.decoders import DecoderSpec
from specdecode.runtime.session import RuntimeConfig
from tests.helpers import run_specdecode

COMMANDS = (["generate", "hi"], ["serve"], ["bench"], ["sweep"], ["eval-drafter", "--data", "d", "--drafter", "x"],
            ["data", "build", "--out", "o", "--prompts", __file__])  # an existing file


def test_every_command_parses_to_the_one_default():
    parser = build_parser()
    for argv in (["generate", "hi"], ["check"], ["serve"]):
        assert decoder_spec(parser.parse_args(argv)).config == AutoSpec() == DecoderSpec().config, argv
    bench = parser.parse_args(["bench", "--methods", "baseline,eagle3"])
    eagle3 = split_methods(bench.methods)[1]
    assert method_decoder_spec(eagle3, bench.drafter).config == AutoSpec()
    assert method_decoder_spec("eagle3:spec=static", None).config == SpecConfig()


def test_every_command_but_check_gets_the_default_format():
    parser = build_parser()
    library = RuntimeConfig()
    for argv in COMMANDS:
        r = runtime_config(parser.parse_args(argv))
        assert (r.dtype, r.weights) == (library.dtype, library.weights) == ("auto", "auto"), argv
    check = runtime_config(parser.parse_args(["check"]))
    assert (check.dtype, check.weights) == ("float32", "auto")  # exactness: auto weights stay native in fp32


def test_flags_override_the_default_field_by_field():
    parser = build_parser()
    chain = decoder_spec(parser.parse_args(["generate", "hi", "--num-steps", "4", "--topk", "1"])).config
    assert chain == AutoSpec(4, 1) and chain.complete and chain.static() == SpecConfig(4, 1)
    deeper = decoder_spec(parser.parse_args(["generate", "hi", "--num-steps", "2"])).config
    assert deeper == AutoSpec(num_steps=2)  # top-k and draft tokens still chosen
    static = decoder_spec(parser.parse_args(["generate", "hi", "--spec-config", "static", "--num-steps", "3"])).config
    assert static == SpecConfig(3, SpecConfig().topk)


@pytest.mark.parametrize("flag", ["--num-steps", "--topk", "--num-draft-tokens"])
def test_zero_is_refused_not_replaced_by_the_default(flag, capsys):
    assert main(["generate", "hi", flag, "0"]) == 2
    assert "must be" in capsys.readouterr().err


@pytest.mark.model
def test_generate_and_bench_measure_the_same_choice(tmp_path):
    """End to end with the shipped drafter: generate and bench's `eagle3` decode with the same
    automatically chosen shape, given the same (eager) steps (the costs measured once, then read from
    the cache)."""
    if default_drafter_path() is None:
        pytest.skip("no shipped drafter in this checkout")
    # eager, as bench's default: auto calibrates the steps a run decodes with, and generate would take the
    # graphs `specdecode compile` stored on this machine (bench stays eager unless told)
    gen = json.loads(run_specdecode("generate", "Hi", "--json", "--max-new-tokens", "4", "--compile", "off").stdout)
    assert (gen["dtype"], gen["weights"]) == ("bfloat16", "q4") or "no bf16" in gen["format_reason"]
    choice = gen["spec_choice"]
    assert choice["how"] == "auto" and choice["costs"].split()[0] in ("measured", "cached")
    assert choice["candidates"][0]["speedup"] >= max(c["speedup"] for c in choice["candidates"])
    out = tmp_path / "bench.json"
    run_specdecode("bench", "--methods", "baseline,eagle3", "--num-prompts", "1", "--max-new-tokens", "4",
                   "--runs", "1", "--warmup", "0", "--no-store", "--out", str(out))
    bench = json.loads(out.read_text())
    shape = {k: choice[k] for k in ("num_steps", "topk", "num_draft_tokens")}
    assert bench["spec_configs"]["eagle3"] == shape
    # generate decodes plain when every shape is predicted slower than plain steps (bench still speculates)
    assert gen["spec_config"] == shape or (gen["spec_config"] is None and choice["candidates"][0]["speedup"] <= 1.0)
    assert bench["spec_choices"]["eagle3"]["costs"].startswith("cached")


@pytest.mark.model
def test_a_drafter_without_acceptance_table_falls_back_to_the_static_default():
    gen = json.loads(run_specdecode("generate", "Hi", "--json", "--drafter", "random", "--max-new-tokens", "4",
                                    "--dtype", "bfloat16").stdout)
    assert gen["spec_choice"]["how"] == "fallback" and "acceptance.json" in gen["spec_choice"]["reason"]
    assert gen["spec_config"] == {"num_steps": 2, "topk": 2, "num_draft_tokens": 5}
