"""`return_token_ids` (vLLM's extension) on our server, and `bench --methods served:url=...`: a
running server measured as one method of a local bench, on the same token ids."""

from __future__ import annotations

import httpx
import pytest

from specdecode.bench.harness import run_interleaved
from specdecode.bench.methods import BaselineMethod, build_method
from specdecode.bench.output import summarize
from specdecode.io.prompts import Prompt
from tests.serving.helpers import CHAT, COMPLETIONS, KEY, NAME, expected, post, scrape, sse_events


def test_return_token_ids_streamed_and_whole(http, loaded, decoder, tokenizer):
    ids = tokenizer.encode("The sea is")
    want = expected(loaded, decoder, ids, 12).token_ids
    whole = post(http, COMPLETIONS, {"model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0,
                                     "return_token_ids": True}).json()
    assert whole["choices"][0]["token_ids"] == want and whole["usage"]["completion_tokens"] == len(want)
    with http.stream("POST", CHAT, json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 9, "temperature": 0, "stream": True,
                                         "return_token_ids": True}) as r:
        events = sse_events(r.iter_lines())
    streamed = [t for e in events if isinstance(e, dict) for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(streamed) == 9
    plain = post(http, COMPLETIONS, {"model": NAME, "prompt": ids, "max_tokens": 4, "temperature": 0}).json()
    assert "token_ids" not in plain["choices"][0]  # only when asked


def test_served_method_interleaves_with_the_local_baseline(server, loaded, monkeypatch):
    monkeypatch.setenv("SPECDECODE_API_KEY", KEY)
    served = build_method(f"served:url={server.url}", session=None)
    assert served.model == NAME
    prompts = [Prompt("a", "qa", ({"role": "user", "content": "x"},)), Prompt("b", "qa", ({"role": "user",
                                                                                        "content": "y"},))]
    encoded = [loaded.tokenizer.encode("Once upon a time"), loaded.tokenizer.encode("1, 2, 3,")]
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"})
    cycles_before = scrape(admin).get("specdecode_spec_cycles_total", 0)
    records = run_interleaved([BaselineMethod("baseline", loaded), served], prompts, encoded, 10, runs=1, warmup=0)
    rows = {r["method"]: r for r in summarize(records, ["baseline", served.name])}
    assert rows[served.name]["outputs_match_baseline"] == "2/2"  # greedy, fp32, lossless: the same ids
    assert all(r["tokens_source"] == "usage" for r in records if r["method"] == served.name)
    # the server's speculative counters around each request: its cycles and accept length, where it speculated
    counted = [r for r in records if r["method"] == served.name and r.get("cycles")]
    cycles = scrape(admin).get("specdecode_spec_cycles_total", 0) - cycles_before
    assert sum(r["cycles"] for r in counted) == cycles
    assert all(r["accept_length"] >= 1 and 0 <= r["accept_rate"] <= 1 for r in counted)


def test_served_method_errors_name_the_fix(server, monkeypatch):
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="served:url=http://HOST:PORT"):
        build_method("served", session=None)
    with pytest.raises(ValueError, match="is the server running"):
        build_method(f"served:url={server.url}", session=None)  # no key: /v1/models is refused
