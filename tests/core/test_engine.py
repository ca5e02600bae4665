"""The text layer (stop tokens, stop strings, streaming) and baseline decoding on a tiny model."""

import pytest
import torch

from specdecode.core.engine import Engine
from specdecode.core.requests import ContextLengthError, GenerateOptions, TextAssembler
from specdecode.core.sampling import SamplingParams
from specdecode.io.tokenizer import Tokenizer
from tests.helpers import plain_steps, tiny_model


class CharTokenizer:
    """Token i is chr(ord('a') + i) for i < 26; 26 is EOS, 27 and 28 halves of an 'é'."""

    eos_token_id = 26

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids, skip_special_tokens=False):
        out = bytearray()
        for i in ids:
            out += {26: b"</s>", 27: b"\xc3", 28: b"\xa9"}.get(i, bytes([ord("a") + i]))
        return out.decode("utf-8", errors="replace")


def tokenizer():
    return Tokenizer(CharTokenizer(), (26,))


def ids(text):
    return [ord(c) - ord("a") for c in text]


def feed(options, chunks):
    asm = TextAssembler(tokenizer(), options)
    out = []
    for c in chunks:
        chunk = asm.add(c)
        out.append(chunk)
        if chunk.finish_reason:
            break
    return asm, out


def test_eos_stops_and_is_not_text():
    asm, out = feed(GenerateOptions(max_new_tokens=50), [ids("ab"), [26], ids("cd")])
    assert asm.text == "ab" and asm.finish_reason == "stop"
    assert asm.token_ids == ids("ab") + [26]


def test_stop_string_across_chunks_is_held_back_and_cut():
    asm, out = feed(GenerateOptions(max_new_tokens=50, stop=("xyz",)), [ids("abx"), ids("y"), ids("zq")])
    assert [c.text for c in out] == ["ab", "", ""]
    assert asm.text == "ab" and asm.finish_reason == "stop"


def test_false_stop_prefix_is_released():
    asm, out = feed(GenerateOptions(max_new_tokens=6, stop=("xyz",)), [ids("abx"), ids("yq"), ids("r")])
    assert "".join(c.text for c in out) == "abxyqr"
    assert asm.finish_reason == "length"


def test_max_new_tokens_truncates_a_multi_token_chunk():
    asm, out = feed(GenerateOptions(max_new_tokens=3), [ids("abcdef")])
    assert asm.token_ids == ids("abc") and asm.finish_reason == "length" and asm.text == "abc"


def test_partial_utf8_is_held_back():
    asm, out = feed(GenerateOptions(max_new_tokens=10), [ids("a") + [27], [28], ids("b")])
    assert [c.text for c in out] == ["a", "é", "b"]


def test_baseline_greedy_equals_naive_argmax_loop():
    model = tiny_model(seed=4)
    prompt = [1, 2, 3, 4]
    got = [t for step in plain_steps(model, prompt, 20, SamplingParams()) for t in step.tokens]
    seq = list(prompt)
    for _ in range(20):  # naive: full recompute, no cache
        logits = model(torch.tensor([seq]), torch.arange(len(seq)), model.new_cache(1, 64)).logits
        seq.append(int(logits[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_engine_generate_and_stream_agree():
    model = tiny_model(seed=5, vocab_size=29)
    engine = Engine(model, tokenizer())
    opts = GenerateOptions(max_new_tokens=12, stop_token_ids=())
    result = engine.generate(ids("abc"), opts)
    streamed = list(engine.stream(ids("abc"), opts))
    assert [t for c in streamed for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in streamed) == result.text
    assert result.num_tokens == 12 and result.finish_reason == "length"
    assert result.to_dict()["tok_per_s"] > 0


def test_seeded_sampling_is_reproducible():
    model = tiny_model(seed=6, vocab_size=29)
    engine = Engine(model, tokenizer())
    opts = GenerateOptions(max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=7), stop_token_ids=())
    assert engine.generate(ids("ab"), opts).token_ids == engine.generate(ids("ab"), opts).token_ids


def test_context_overflow_message_has_numbers():
    model = tiny_model()
    with pytest.raises(ContextLengthError, match=r"prompt \(250 tokens\) \+ max_new_tokens \(10\) = 260 exceeds"):
        next(plain_steps(model, [1] * 250, 10, SamplingParams()))


def test_the_profile_splits_host_work_from_model_calls():
    """A speculative run's profile: each cycle's time outside model calls (host) and how many calls it made
    (a chain of 3 steps: a re-extend, two draft levels and a verify), the loop's time around the cycles, and
    the table prints them; the phases still sum to the cycle (host and calls are not phases)."""
    from specdecode.core.drafter import random_drafter
    from specdecode.core.profiler import PHASES, format_profile
    from specdecode.core.speculative import Eagle3Decoder, SpecConfig

    model = tiny_model(seed=5, vocab_size=29)
    engine = Engine(model, tokenizer(), Eagle3Decoder(random_drafter(model, seed=1), SpecConfig(3, 1, 4)))
    stats = engine.generate(ids("abc"), GenerateOptions(max_new_tokens=24, stop_token_ids=())).stats
    # every cycle but the first (the prompt's pairs went through the drafter before it) re-extends
    n = stats["cycles"]
    assert stats["model_calls_per_cycle"] == pytest.approx((4 * n - 1) / n)
    assert 0 < stats["host_ms_per_cycle"] < stats["cycle_ms"] and stats["loop_ms_per_cycle"] >= 0
    assert sum(p["ms_per_cycle"] for p in stats["phases"].values()) == pytest.approx(stats["cycle_ms"])
    assert set(stats["phases"]) == set(PHASES)
    text = format_profile(stats | {"num_tokens": 24})
    assert "of which host:" in text and "model calls a cycle" in text and "Loop, not cycle:" in text
