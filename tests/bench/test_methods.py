"""The method-string grammar (one parser for bench and sweep) and the sweep's grid."""

import re

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
    hybrid = method_decoder_spec("eagle3:steps=1,topk=1,ngram=6,budget=1")
    assert (hybrid.ngram, hybrid.verify_budget) == (6, True)
    for bad, match in (("eagle3:ngram=x", "ngram must be a count"), ("eagle3:budget=2", "budget must be 0 or 1"),
                       ("eagle3:ngram=2,adapt=1", "use one of them")):
        with pytest.raises(ValueError, match=match):
            method_decoder_spec(bad)
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


class FakeLlama:
    """llama_cpp.Llama as LlamaCppMethod uses it: records its settings and resets, yields a script."""

    instances: list = []

    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, verbose):
        self.settings = {"model_path": model_path, "n_threads": n_threads, "n_threads_batch": n_threads_batch}
        self.resets = 0
        self.calls = []
        FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **sampling):
        self.calls.append((list(tokens), sampling))
        yield from [11, 12, 2, 13, 14]  # 2 is a stop token


def test_llamacpp_method_runs_greedy_on_the_gguf_and_stops_like_ours(tmp_path, monkeypatch):
    import sys
    import types

    from specdecode.bench.methods import LlamaCppMethod

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    method = LlamaCppMethod("llamacpp", gguf, threads=2, stop_ids=[2])
    llm = FakeLlama.instances[-1]
    assert llm.settings == {"model_path": str(gguf), "n_threads": 2, "n_threads_batch": 2}
    out = method.run([5, 6, 7], max_new_tokens=10)
    assert out.token_ids == [11, 12, 2]  # the stop token included, as our engine does
    assert llm.resets == 1 and llm.calls[0][0] == [5, 6, 7]
    sampling = llm.calls[0][1]
    assert sampling["temp"] == 0.0 and sampling["top_k"] == 1 and sampling["repeat_penalty"] == 1.0
    assert method.run([5], max_new_tokens=2).token_ids == [11, 12] and llm.resets == 2
    assert 0 <= out.ttft_s <= out.elapsed_s
    with pytest.raises(ValueError, match="runs a GGUF file"):
        LlamaCppMethod("llamacpp", tmp_path, threads=2, stop_ids=[2])


def test_llamacpp_method_without_the_package_names_the_install(tmp_path, monkeypatch):
    import sys

    from specdecode.bench.methods import LlamaCppMethod

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"pip install 'specdecode\[llamacpp\]'"):
        LlamaCppMethod("llamacpp", gguf, threads=2, stop_ids=[2])


def test_vllm_method_strings_are_checked_before_anything_starts(monkeypatch, tmp_path):
    """`vllm[:spec=eagle3,n=N,...]`: its parameters refused with the fix before any model or server starts, and a
    machine without vLLM's environment told how to make one."""
    from specdecode.bench.methods import check_method
    from specdecode.bench.vllmserver import vllm_python

    assert check_method("vllm:spec=eagle3,n=3,dtype=float32") == ("vllm", {"spec": "eagle3", "n": "3",
                                                                              "dtype": "float32"})
    for bad, why in (("vllm:spec=medusa", "spec must be eagle3"), ("vllm:spec=eagle3,n=0", "n must be >= 1"),
                     ("vllm:spec=eagle3,n=two", "n (tokens drafted a cycle) must be an integer"),
                     ("vllm:n=2", "add spec=eagle3"), ("vllm:dtype=int8", "dtype must be one of"),
                     ("vllm:port=1", "unknown parameter")):
        with pytest.raises(ValueError, match=re.escape(why)):
            check_method(bad)
    monkeypatch.delenv("SPECDECODE_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="scripts/setup_vllm.sh"):
        vllm_python(str(tmp_path / "no-python"))
    given = tmp_path / "python"
    given.write_text("")
    assert vllm_python(str(given)) == str(given)
