"""The server's metrics: the Prometheus text of /metrics (rendered by ``io.prometheus`` and
read back by its parser), the periodic decode log line, and /metrics of a served model adding up
the same speculative cycles the engine measures."""

from __future__ import annotations

import httpx
import pytest

from specdecode.core.batching import BatchConfig
from specdecode.core.engine import Engine
from specdecode.core.profiler import SpecProfile
from specdecode.core.requests import GenerateOptions
from specdecode.core.selfdraft import SelfDrafter
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.prometheus import Family, Sample, format_value, parse_prometheus, render_prometheus
from specdecode.serving.app import create_app
from specdecode.serving.metrics import Metrics, Snapshot, decode_log_line
from tests.serving.helpers import NAME, Running, scrape


def test_decode_log_line():
    a = Snapshot(0.0, 0, 0, 0, 0)
    b = Snapshot(10.0, 412, 100, 300, 171, steps=120, step_rows=300, spec_steps=100)
    assert decode_log_line(a, b, 3, 1) == \
        ("decode: #running-req 3, #queue-req 1, batch 2.5, spec steps 83%, accept len 2.71, accept rate 0.57, "
         "gen throughput 41.2 tok/s")
    assert decode_log_line(a, Snapshot(2.0, 20, 0, 0, 0), 0, 0) == \
        "decode: #running-req 0, #queue-req 0, gen throughput 10.0 tok/s"
    assert decode_log_line(a, Snapshot(2.0, 20, 0, 0, 0, prompt=400, cached=100), 0, 0) == \
        "decode: #running-req 0, #queue-req 0, gen throughput 10.0 tok/s, prompt tokens 400 (25% cached)"


def test_metrics_text_round_trips_through_the_parser():
    m = Metrics(max_depth=3)
    m.count_request("/v1/completions", 200)
    m.count_request("/v1/completions", 200)
    m.count_request("other", 404)
    m.count_prompt(17)
    m.count_prompt(40, cached=32)
    m.count_tokens(5, 0.03, None)
    m.count_tokens(3, None, 0.0123)
    m.spec.cycles, m.spec.drafted, m.spec.accepted = 4, 12, 7
    m.spec.depth_hist.update({0: 1, 2: 2, 3: 1})
    text = m.render(1, 2)
    assert text.endswith("\n") and "# TYPE specdecode_time_to_first_token_seconds histogram" in text
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_prometheus(text)}
    assert got["specdecode_requests_total", (("route", "/v1/completions"), ("status", "200"))] == 2
    assert got["specdecode_requests_running", ()] == 1 and got["specdecode_requests_queued", ()] == 2
    assert got["specdecode_generation_tokens_total", ()] == 8
    assert got["specdecode_time_to_first_token_seconds_bucket", (("le", "0.05"),)] == 1
    assert got["specdecode_time_to_first_token_seconds_bucket", (("le", "+Inf"),)] == 1
    assert got["specdecode_time_per_output_token_seconds_count", ()] == 3
    assert [got["specdecode_spec_accepted_per_position_total", (("position", str(i)),)] for i in (1, 2, 3)] == \
        [3, 3, 1]
    assert "specdecode_prompt_tokens_total 57\n" in text  # integers stay integers
    assert got["specdecode_prefix_cache_hit_tokens_total", ()] == 32


@pytest.mark.parametrize("value,text", [(3, "3"), (0.25, "0.25"), (0.0, "0.0"), (float("inf"), "+Inf"),
                                        (float("-inf"), "-Inf"), (float("nan"), "NaN")])
def test_format_value(value, text):
    assert format_value(value) == text


def test_labels_are_escaped_and_parsed_back():
    family = Family("x_total", "counter", "Things.", [Sample("x_total", {"path": 'a"b\\c\nd'}, 1)])
    text = render_prometheus([family])
    assert text == '# HELP x_total Things.\n# TYPE x_total counter\nx_total{path="a\\"b\\\\c\\nd"} 1\n'
    assert parse_prometheus(text) == [Sample("x_total", {"path": 'a"b\\c\nd'}, 1.0)]


def test_spec_metrics_match_engine_profile(loaded, tokenizer):
    """/metrics adds up the same cycles the engine measures, here with a self-drafter
    (the target proposing its own tokens) so that accepted positions are non-zero."""
    ids = tokenizer.encode("Counting: one, two, three,")
    decoder = Eagle3Decoder(SelfDrafter(loaded.model, loaded.model, ids[0]), SpecConfig(3, 1))
    profile = SpecProfile()
    tokens = sum(len(c.token_ids) for c in Engine(loaded.model, loaded.tokenizer, decoder).stream(
        ids, GenerateOptions(40), profile))
    assert profile.accepted > 0
    running = Running(create_app(loaded, decoder, NAME, batch=BatchConfig(spec_policy="always")))
    try:
        r = httpx.post(running.url + "/v1/completions",
                       json={"model": NAME, "prompt": ids, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens
        m = scrape(httpx.Client(base_url=running.url))
    finally:
        running.stop()
    assert m["specdecode_spec_cycles_total"] == profile.cycles
    assert m["specdecode_spec_draft_tokens_total"] == profile.drafted
    assert m["specdecode_spec_accepted_tokens_total"] == profile.accepted
    for i in (1, 2, 3):
        reached = sum(c for a, c in profile.depth_hist.items() if a >= i)
        assert m[f'specdecode_spec_accepted_per_position_total{{position="{i}"}}'] == reached
    assert m["specdecode_generation_tokens_total"] == tokens
    assert m['specdecode_requests_total{route="/v1/completions",status="200"}'] == 1
    phases = {p: m[f'specdecode_spec_phase_seconds_total{{phase="{p}"}}']
              for p in ("draft", "verify", "extend", "other")}
    assert all(v > 0 for v in phases.values())
