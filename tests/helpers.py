"""Test helpers (tiny models, a tiny HF directory, the CLI in a fresh process). Imported by
tests as ``from tests.helpers import ...``; fixtures live in ``conftest.py``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from specdecode.core.model import ModelConfig, Transformer
from specdecode.core.profiler import CycleRecord


def tiny_config(**overrides) -> ModelConfig:
    base = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_layers": 6, "num_heads": 4,
                "num_kv_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # larger than default init: logits far from uniform
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval().requires_grad_(False)


def run_specdecode(*args, env=None, check=True, timeout=300):
    """The console script in a fresh process; ``env`` entries set (or, with None, remove)
    variables on top of this process's environment."""
    full_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    proc = subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def save_tiny_hf(tmp_path, model_type="llama", **cfg_overrides):
    import transformers

    common = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                  "rms_norm_eps": 1e-6, "rope_theta": 5000.0, "tie_word_embeddings": False}
    common.update(cfg_overrides)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def perturbed(model, scale, seed):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return other


@dataclass
class Step:
    """What one step of a request alone gave: its new tokens and, for a speculative step, its cycle."""

    tokens: list[int]
    cycle: CycleRecord | None = None


def decode_steps(target, drafter, prompt, max_new_tokens, sampling, generator=None, config=None, policy=None):
    """A request alone through the engine (``Engine.batch_for``: a batch of one row), step by step: the
    first token, then one ``Step`` per decode step (a cycle when ``drafter`` is given, with ``config``'s
    shape, re-chosen by ``policy`` after each cycle); no stop tokens. ``generator``: the request's draws."""
    from specdecode.core.engine import Engine, baseline_decode
    from specdecode.core.requests import GenerateOptions, TokenIdsOnly
    from specdecode.core.speculative import Eagle3Decoder

    decoder = baseline_decode if drafter is None else Eagle3Decoder(
        drafter, config, adapt=(lambda: policy) if policy is not None else None)
    options = GenerateOptions(max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=())
    batch = Engine(target, TokenIdsOnly(()), decoder).batch_for(len(prompt), options)
    with torch.inference_mode():  # as Engine.stream
        batch.add(0, prompt, options, generator)
    report = batch.step(decode=False)
    yield Step([t for _, chunk in report.events for t in chunk.token_ids])
    while not report.finished:
        report = batch.step()
        cycles = report.cycle_records()
        yield Step([t for _, chunk in report.events for t in chunk.token_ids], cycles[0] if cycles else None)


def plain_steps(model, prompt, max_new_tokens, sampling, generator=None):
    """Plain decoding of a request alone, step by step (``decode_steps`` without a drafter)."""
    return decode_steps(model, None, prompt, max_new_tokens, sampling, generator)


def eagle3_steps(target, drafter, prompt, max_new_tokens, sampling, generator, config, policy=None):
    """EAGLE-3 decoding of a request alone, cycle by cycle (``decode_steps``)."""
    return decode_steps(target, drafter, prompt, max_new_tokens, sampling, generator, config, policy)


def tiny_model_dir(where):
    """A tiny HF model directory a `specdecode` command can load: weights, a word-level tokenizer, a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_tiny_hf(where, max_position_embeddings=512)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1",
        "chat_template": "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"}))
