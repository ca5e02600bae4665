"""--spec-config auto (runtime.autospec) on a tiny float64 model: the choice is the cost model's
best over measured costs and the drafter's acceptance table, cached per setting; flags are kept;
a drafter without a table falls back to SpecConfig(), saying why."""

import json
import os
from pathlib import Path

import pytest
import torch

from specdecode.core.costmodel import AutoSpec, candidate_shapes
from specdecode.core.drafter import random_drafter
from specdecode.core.speculative import SpecConfig
from specdecode.io.checkpoints import ACCEPTANCE_FILE, save_drafter, write_acceptance
from specdecode.io.errors import DrafterMismatchError
from specdecode.io.loading import LoadedModel
from specdecode.runtime.autospec import DEFERRED_SHAPE, choose_spec
from specdecode.runtime.decoders import DecoderSpec, build_decoder
from specdecode.runtime.session import RuntimeConfig, Session
from tests.helpers import tiny_model

TABLE = {1: [0.7, 0.5, 0.35, 0.25, 0.15, 0.1], 2: [0.8, 0.6, 0.45, 0.3, 0.2, 0.15], 4: [0.85, 0.65, 0.5]}


class ChatIds:
    """The calibration only needs a chat prompt's token ids."""

    eos_token_ids = ()

    def encode_chat(self, messages):
        return list(range(3, 60))


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    model = tiny_model()
    loaded = LoadedModel(model, ChatIds(), Path("tiny"), Path("tiny"))
    session = Session(RuntimeConfig(dtype="float64", weights="native"), loaded, torch.device("cpu"), torch.float64, 1)
    path = tmp_path / "drafter"
    drafter = random_drafter(model, draft_vocab_size=50, seed=2)
    save_drafter(drafter, path)
    write_acceptance(path, TABLE, {"samples": 3, "dtype": "float64", "weights": "native"})
    return session, drafter, str(path)


def test_auto_picks_the_best_prediction_and_caches_the_costs(setup):
    session, drafter, path = setup
    first = choose_spec(AutoSpec(), session, drafter, path)
    assert first.how == "auto" and first.config in candidate_shapes()
    speeds = [c["speedup"] for c in first.candidates]  # ranked by speedup over the plain step timed beside each
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == len(candidate_shapes())
    assert first.prediction.shape == first.config and first.costs_source.startswith("measured")
    again = choose_spec(AutoSpec(), session, drafter, path)
    assert again.costs_source.startswith("cached") and again.measure_s == 0
    assert again.config == first.config  # same costs, same table: same choice
    d = again.to_dict()
    assert d["predicted_speedup"] == pytest.approx(first.prediction.speedup, rel=1e-3) and "acceptance" in d


def test_a_deferred_choice_decodes_the_cheap_shape_until_the_costs_are_cached(setup):
    """A first run (generate, its graphs built after it) does not time the cycle costs before its first
    token: without cached costs it decodes DEFERRED_SHAPE (the flags' static shape where flags were
    given) and says why; once the costs are cached, the deferring run chooses by them like any other."""
    session, drafter, path = setup
    first = choose_spec(AutoSpec(), session, drafter, path, defer=True)
    assert first.how == "deferred" and first.config == DEFERRED_SHAPE and first.costs is None
    assert "no cycle costs measured" in first.summary() and not (Path(os.environ["SPECDECODE_CACHE"])
                                                                  / "spec-costs").exists()
    assert choose_spec(AutoSpec(num_steps=3), session, drafter, path, defer=True).config.num_steps == 3
    measured = choose_spec(AutoSpec(), session, drafter, path)  # what the build after the run does
    later = choose_spec(AutoSpec(), session, drafter, path, defer=True)
    assert later.how == "auto" and later.costs_source.startswith("cached") and later.config == measured.config


def test_flags_are_kept_and_the_rest_chosen(setup):
    session, drafter, path = setup
    chain = choose_spec(AutoSpec(topk=1), session, drafter, path)
    assert chain.how == "auto" and chain.config.topk == 1
    assert all(c["topk"] == 1 for c in chain.candidates)
    full = choose_spec(AutoSpec(3, 1), session, drafter, path)
    assert (full.how, full.config) == ("flags", SpecConfig(3, 1))
    static = choose_spec(SpecConfig(), session, drafter, path)
    assert (static.how, static.config) == ("static", SpecConfig())


def test_no_table_falls_back_and_a_bad_table_is_refused(setup):
    session, drafter, path = setup
    (Path(path) / ACCEPTANCE_FILE).unlink()
    fallback = choose_spec(AutoSpec(num_steps=3), session, drafter, path)
    assert fallback.how == "fallback" and fallback.config == SpecConfig(3, SpecConfig().topk)
    assert "eval-drafter --acceptance-table" in fallback.reason
    (Path(path) / ACCEPTANCE_FILE).write_text(json.dumps({"format": "nope"}))
    with pytest.raises(DrafterMismatchError, match="rebuild it with"):
        choose_spec(AutoSpec(), session, drafter, path)


def test_a_table_measured_on_other_weights_is_not_used(setup):
    """A drafter trained again into its directory keeps the old acceptance.json: the table records the
    fingerprint of the weights it was measured on, and auto falls back (naming the fix) when they differ."""
    from specdecode.io.paths import file_fingerprint

    session, drafter, path = setup
    weights = Path(path) / "model.safetensors"
    write_acceptance(path, TABLE, {"samples": 3, "dtype": "float64", "weights": "native",
                                   "drafter_weights": file_fingerprint(weights)})
    assert choose_spec(AutoSpec(), session, drafter, path).how == "auto"
    save_drafter(random_drafter(tiny_model(), draft_vocab_size=50, seed=3), path)  # trained again: new weights
    stale = choose_spec(AutoSpec(), session, drafter, path)
    assert stale.how == "fallback" and stale.config == SpecConfig()
    assert "measured on other weights" in stale.reason and "eval-drafter --acceptance-table" in stale.reason


def test_the_factory_decodes_with_the_choice_and_adapts_on_request(setup):
    session, drafter, path = setup
    # allow_plain=False: on this tiny random model the best shape is predicted at about 1.0x plain
    # decoding, so which side wins is the clock's call; the factory must decode with the choice either way
    decoder = build_decoder(DecoderSpec(drafter=path, allow_plain=False), session)
    assert decoder.choice.how == "auto" and decoder.config == decoder.choice.config
    plain_or_not = build_decoder(DecoderSpec(drafter=path), session)
    assert (plain_or_not.config is None) == plain_or_not.choice.plain_is_faster
    adaptive = build_decoder(DecoderSpec(drafter=path, adapt=True, allow_plain=False), session)
    assert adaptive.decode.adapt is not None and "adaptive" in adaptive.description
    assert adaptive.decode.max_depth == max(s.max_depth for s in candidate_shapes())


def write_costs(session, drafter, path, verify_per_token):
    """A cost table in the cache, as if measured: a verify costing 10 ms + verify_per_token per extra node."""
    from specdecode.core.costmodel import CycleCosts, ShapeCost, shape_key
    from specdecode.runtime.autospec import costs_key, costs_path

    costs = CycleCosts(10.0, {shape_key(s): ShapeCost(0.5 * (s.num_steps - 1) * s.topk,
                                                      10.0 + verify_per_token * (s.num_draft_tokens - 1), 0.3)
                              for s in candidate_shapes()}, {1: 0.8, 7: 2.0})
    target = costs_path(costs_key(session, drafter, path))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"costs": costs.to_dict()}))
    return costs


def test_the_choice_is_the_cost_models_best_and_follows_the_costs(setup):
    from specdecode.core.costmodel import AcceptanceTable, best_shape

    session, drafter, path = setup
    table = AcceptanceTable(TABLE)
    cheap = write_costs(session, drafter, path, verify_per_token=0.05)
    deep = choose_spec(AutoSpec(), session, drafter, path)
    assert deep.costs_source.startswith("cached")
    assert deep.config == best_shape(candidate_shapes(), table, cheap)[0].shape
    dear = write_costs(session, drafter, path, verify_per_token=5.0)
    shallow = choose_spec(AutoSpec(), session, drafter, path)
    assert shallow.config == best_shape(candidate_shapes(), table, dear)[0].shape
    assert shallow.config.num_draft_tokens < deep.config.num_draft_tokens  # a dear verify verifies fewer nodes
    given = choose_spec(AutoSpec(num_draft_tokens=8), session, drafter, path)  # a node count no default shape has
    assert given.how == "auto" and given.config.num_draft_tokens == 8


class StoredTargetGraphs:
    """A graph store holding the tiny target's steps (run eager here, counted), never building one."""

    def __init__(self, names):
        self.stored, self.calls = names, 0

    def names(self, module):
        return list(self.stored) if isinstance(module, type(self.model)) else []

    def load(self, module, key, step):
        if not key.kind.startswith("target"):
            return None  # the drafter's buckets: none stored, so they run eager

        def graph(*args):
            self.calls += 1
            return step(*args)
        return graph

    def build(self, module, key, step, args, dynamic_shapes=None):
        raise AssertionError("a calibration must not compile graphs")


def test_calibration_times_the_runs_stored_graphs_and_a_new_graph_measures_again(setup):
    from specdecode.core.compiled import CompiledRunner
    from specdecode.runtime.autospec import calibration_graphs, costs_key, costs_path

    session, drafter, path = setup
    eager_key = costs_key(session, drafter, path)
    assert eager_key["graphs"] is None  # eager steps: the calibration runs eager
    store = StoredTargetGraphs(["target-r1-t1-s256.pt2"])
    store.model = session.loaded.model
    session.compiled = CompiledRunner("cpu", store=store)  # builds in the run, not here
    try:
        assert calibration_graphs(session, drafter) == ["target-r1-t1-s256.pt2"]
        choice = choose_spec(AutoSpec(), session, drafter, path)
        assert choice.costs_source.startswith("measured") and store.calls > 0  # stored graphs were timed
        assert session.compiled.build  # the run's own steps still build
        first = costs_path(costs_key(session, drafter, path))
        assert first != costs_path(eager_key)
        store.stored.append("target-r1-t4-s256.pt2")  # `specdecode compile` stored another graph
        assert costs_path(costs_key(session, drafter, path)) != first
    finally:
        session.compiled = None
