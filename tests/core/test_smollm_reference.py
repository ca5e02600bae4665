"""The real SmolLM2-135M GGUF against transformers loading the same file (fp32)."""

import pytest
import torch

from specdecode.core.engine import Engine
from specdecode.core.requests import GenerateOptions

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.",
]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_logits_match_transformers(smollm, hf_smollm, prompt):
    ids = smollm.tokenizer.encode_chat(prompt)
    x = torch.tensor([ids])
    with torch.inference_mode():
        expected = hf_smollm(x).logits
        got = smollm.model(x, torch.arange(len(ids)), smollm.model.new_cache(1, 256)).logits
    diff = (got - expected).abs().max().item()
    assert diff < 1e-4, f"max |logit difference| {diff:.2e} >= 1e-4"


def test_decode_step_logits_match_transformers(smollm, hf_smollm):
    """Single-token decode steps (our small-batch matmul path) against a full HF forward."""
    ids = smollm.tokenizer.encode_chat(PROMPTS[0])
    extra = [504, 3575, 282, 4649, 314]
    model = smollm.model
    cache = model.new_cache(1, 256)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(len(ids)), cache)
        steps = [model(torch.tensor([[t]]), torch.tensor([cache.length]), cache).logits[0, 0] for t in extra]
        expected = hf_smollm(torch.tensor([ids + extra])).logits[0, len(ids):]
    diff = (torch.stack(steps) - expected).abs().max().item()
    assert diff < 1e-4, f"max |logit difference| {diff:.2e} >= 1e-4"


def test_greedy_matches_transformers_generate(smollm, hf_smollm):
    engine = Engine(smollm.model, smollm.tokenizer)
    eos = list(smollm.tokenizer.eos_token_ids)
    compared = 0
    for prompt in PROMPTS + ["Write a short story about a robot who learns to paint."]:
        ids = smollm.tokenizer.encode_chat(prompt)
        ours = engine.generate(ids, GenerateOptions(max_new_tokens=128)).token_ids
        with torch.inference_mode():
            out = hf_smollm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=128, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        theirs = out[0, len(ids):].tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        assert ours == theirs, f"{prompt!r}: first difference at token {first_diff} of {len(ours)}/{len(theirs)}"
        compared += len(ours)
    assert compared >= 300, f"only {compared} tokens compared: prompts ended too early to be a real test"


def test_tokenizer_and_chat_template(smollm):
    tok = smollm.tokenizer
    text = tok.chat_prompt("Hi")
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"
    assert tok.eos_token_ids == (2,)


def test_bf16_generates_sensible_text(smollm):
    from specdecode.io.loading import load_model

    loaded = load_model(None, "bfloat16", "cpu")
    assert loaded.model.dtype == torch.bfloat16
    engine = Engine(loaded.model, loaded.tokenizer)
    r = engine.generate(loaded.tokenizer.encode_chat(PROMPTS[0]), GenerateOptions(max_new_tokens=16))
    assert "Paris" in r.text
