"""The method-string grammar (one parser for bench and sweep) and the sweep's grid."""

import pytest

from specdecode.bench.methods import method_decoder_spec, method_spec_config, parse_method, split_methods
from specdecode.bench.sweep import grid
from specdecode.core.speculative import SpecConfig


def test_split_and_parse_methods():
    specs = split_methods("baseline, eagle3:steps=2,topk=1,hf,eagle3:steps=5,topk=4,draft_tokens=16,eagle3")
    assert specs == ["baseline", "eagle3:steps=2,topk=1", "hf", "eagle3:steps=5,topk=4,draft_tokens=16", "eagle3"]
    assert parse_method("eagle3:steps=2,drafter=random") == ("eagle3", {"steps": "2", "drafter": "random"})
    with pytest.raises(ValueError, match="expected key=value"):
        parse_method("eagle3:steps")


def test_eagle3_method_configs():
    assert method_spec_config("eagle3") == SpecConfig()  # no parameters: the one default
    c = method_spec_config("eagle3:steps=2,topk=2,draft_tokens=4")
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (2, 2, 4)
    assert method_spec_config("eagle3:steps=3,topk=1").num_draft_tokens == 4  # a chain verifies all of it
    assert method_decoder_spec("eagle3:drafter=random", "other").drafter == "random"
    assert method_decoder_spec("eagle3", "other").drafter == "other"
    for bad, match in (("eagle3:depth=2", "unknown parameter"), ("eagle3:steps=x", "must be integers"),
                       ("baseline", "not an eagle3")):
        with pytest.raises(ValueError, match=match):
            method_spec_config(bad)


def test_sweep_grid_round_trips_through_the_parser():
    specs = grid([1, 2], [1, 2], None)
    assert specs == ["eagle3:steps=1,topk=1", "eagle3:steps=1,topk=2,draft_tokens=3", "eagle3:steps=2,topk=1",
                     "eagle3:steps=2,topk=2,draft_tokens=5"]
    assert [method_spec_config(s).num_draft_tokens for s in specs] == [2, 3, 3, 5]
    assert grid([1], [2], [2, 3, 9]) == ["eagle3:steps=1,topk=2,draft_tokens=2", "eagle3:steps=1,topk=2,draft_tokens=3"]
