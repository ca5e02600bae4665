"""The one decoder factory (runtime.decoders) on a tiny model in a hand-built Session: which
drafter a spec resolves to, the baseline, the drafter cache and the default SpecConfig. Nothing
here loads the real model."""

from pathlib import Path

import pytest
import torch

from specdecode.core.costmodel import AutoSpec
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import baseline_decode
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io import paths
from specdecode.io.checkpoints import save_drafter
from specdecode.io.errors import ModelLoadError
from specdecode.io.loading import LoadedModel
from specdecode.io.paths import default_drafter_path
from specdecode.io.tokenizer import Tokenizer
from specdecode.runtime import decoders
from specdecode.runtime.decoders import RANDOM_DRAFTER, DecoderSpec, build_decoder, resolve_drafter_path
from specdecode.runtime.session import RuntimeConfig, Session
from tests.helpers import plain_steps, tiny_model


class NoTokenizer:
    """The factory never tokenizes; a Session still needs a tokenizer object."""


def session(model_path=None):
    model = tiny_model()
    loaded = LoadedModel(model, Tokenizer(NoTokenizer(), ()), Path("tiny"), Path("tiny"))
    return Session(RuntimeConfig(model=model_path, dtype="float64"), loaded, torch.device("cpu"),
                   torch.float64, threads=1)


@pytest.fixture
def saved_drafter(tmp_path):
    """A random drafter for the tiny model, saved as a checkpoint directory."""
    path = tmp_path / "drafter"
    save_drafter(random_drafter(tiny_model(), draft_vocab_size=50, seed=2), path)
    return str(path)


@pytest.fixture
def count_loads(monkeypatch):
    """Counts checkpoint loads by the factory (the real loader still runs)."""
    calls = []
    real = decoders.load_drafter

    def counting(path, model, **kwargs):
        calls.append(str(path))
        return real(path, model, **kwargs)

    monkeypatch.setattr(decoders, "load_drafter", counting)
    return calls


def test_default_spec_is_the_shipped_drafter_for_the_default_model_only():
    shipped = default_drafter_path()
    assert resolve_drafter_path(DecoderSpec(), session(None)) == (str(shipped) if shipped else None)
    # any other model: no drafter applies, so the default spec decodes with the baseline
    other = session("some/other-model.gguf")
    assert resolve_drafter_path(DecoderSpec(), other) is None
    decoder = build_decoder(DecoderSpec(), other)
    assert decoder.decode == baseline_decode and decoder.description == "baseline"
    assert not decoder.is_speculative and decoder.drafter_path is None and decoder.config is None


def test_the_default_gguf_under_another_path_still_gets_the_shipped_drafter(tmp_path):
    # a file of another content is not the default model, whatever its name
    impostor = tmp_path / paths.DEFAULT_GGUF_NAME
    impostor.write_bytes(b"GGUF" + bytes(64))
    assert not paths.is_default_model(impostor) and paths.shipped_drafter_for(impostor) is None
    assert not paths.is_default_model(tmp_path / "missing.gguf") and paths.is_default_model(None)
    try:
        real = paths.default_model_path()
    except ModelLoadError:
        pytest.skip("the default model package is not installed")
    # the pinned fingerprint is the packaged file's: a copy elsewhere (here a link) is the default model
    assert paths.file_fingerprint(real) == paths.DEFAULT_GGUF_FINGERPRINT
    copy = tmp_path / "target.gguf"
    copy.symlink_to(real)
    assert paths.is_default_model(copy)
    assert resolve_drafter_path(DecoderSpec(), session(str(copy))) == (
        str(default_drafter_path()) if default_drafter_path() else None)


def test_default_spec_builds_eagle3_with_the_shipped_drafter(monkeypatch, saved_drafter, count_loads):
    """With the default model, DecoderSpec() loads whatever default_drafter_path() names."""
    monkeypatch.setattr(paths, "SHIPPED_DRAFTER", Path(saved_drafter))
    decoder = build_decoder(DecoderSpec(), session(None))
    assert decoder.is_speculative and decoder.drafter_path == saved_drafter
    assert count_loads == [saved_drafter]


@pytest.mark.parametrize("drafter", [None, RANDOM_DRAFTER, "/not/even/a/directory"])
def test_speculative_false_is_the_baseline(drafter):
    s = session(None)
    spec = DecoderSpec(speculative=False, drafter=drafter)
    assert resolve_drafter_path(spec, s) is None
    decoder = build_decoder(spec, s)
    assert decoder.decode == baseline_decode and decoder.description == "baseline"
    assert not decoder.is_speculative and decoder.config is None


def test_random_drafter_is_built_once_and_shared():
    s = session("some/other-model.gguf")
    cache: dict = {}
    first = build_decoder(DecoderSpec(drafter=RANDOM_DRAFTER), s, cache)
    second = build_decoder(DecoderSpec(drafter=RANDOM_DRAFTER, config=SpecConfig(3, 1)), s, cache)
    key = (RANDOM_DRAFTER, "native")  # by path and weight format (a float32 target: the drafter as loaded)
    assert list(cache) == [key]
    assert isinstance(first.decode, Eagle3Decoder) and isinstance(second.decode, Eagle3Decoder)
    assert first.decode.drafter is second.decode.drafter is cache[key]
    drafter = cache[key]
    assert drafter.config.draft_vocab_size == min(decoders.RANDOM_DRAFT_VOCAB, s.loaded.model.config.vocab_size)
    assert drafter.embed_tokens is s.loaded.model.embed_tokens  # wired to this target
    assert first.drafter_path == second.drafter_path == RANDOM_DRAFTER
    assert second.config == SpecConfig(3, 1) and second.decode.config == SpecConfig(3, 1)


def test_drafter_path_is_loaded_once_and_shared(saved_drafter, count_loads):
    s = session("some/other-model.gguf")
    cache: dict = {}
    decs = [build_decoder(DecoderSpec(drafter=saved_drafter, config=c), s, cache)
            for c in (SpecConfig(), SpecConfig(2, 1), SpecConfig(1, 2, 3))]
    assert count_loads == [saved_drafter]  # three configurations, one load
    key = (saved_drafter, "native")
    assert list(cache) == [key]
    assert all(isinstance(d.decode, Eagle3Decoder) and d.decode.drafter is cache[key] for d in decs)
    assert cache[key].config.draft_vocab_size == 50
    # without a shared cache every call loads again
    build_decoder(DecoderSpec(drafter=saved_drafter), s)
    assert count_loads == [saved_drafter, saved_drafter]


def test_decoder_config_without_acceptance_table_falls_back_to_spec_config(saved_drafter):
    s = session("some/other-model.gguf")
    for spec in (DecoderSpec(drafter=RANDOM_DRAFTER), DecoderSpec(drafter=saved_drafter)):
        decoder = build_decoder(spec, s)
        assert spec.config == AutoSpec()  # the default asks for a measured choice ...
        assert decoder.choice.how == "fallback"  # ... which needs the drafter's acceptance.json
        assert decoder.config == SpecConfig() and decoder.is_speculative
        assert isinstance(decoder.decode, Eagle3Decoder) and decoder.decode.config == SpecConfig()
        c = SpecConfig()
        assert decoder.description == (f"eagle3 (drafter {spec.drafter}, steps={c.num_steps}, topk={c.topk}, "
                                       f"draft_tokens={c.num_draft_tokens})")
        assert decoder.decode.sync and decoder.decode.comm is None  # no tensor parallelism here


def test_built_decoder_runs_on_the_session_model():
    s = session("some/other-model.gguf")
    decoder = build_decoder(DecoderSpec(drafter=RANDOM_DRAFTER), s)
    from specdecode.core.engine import Engine
    from specdecode.core.requests import GenerateOptions, TokenIdsOnly
    from specdecode.core.sampling import SamplingParams

    prompt = [5, 17, 3, 42, 8]
    options = GenerateOptions(max_new_tokens=12, stop_token_ids=())
    spec = Engine(s.loaded.model, TokenIdsOnly(()), decoder.decode).generate(prompt, options).token_ids
    base = [t for step in plain_steps(s.loaded.model, prompt, 12, SamplingParams()) for t in step.tokens]
    assert spec[:12] == base
