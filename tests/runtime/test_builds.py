"""The library builds and runs stored graphs like the CLI (``runtime.builds``): a first ``start()`` on an empty
cache runs eager and ``build_missing`` stores what it ran eager, in the background; the second ``start()`` runs
those graphs, with no command in between, and decodes the same tokens (float64: exactly)."""

from __future__ import annotations

import json
import os

import torch

from specdecode import DecoderSpec, Engine, GenerateOptions, RuntimeConfig, build_decoder, build_missing, start
from specdecode.runtime import background
from tests.helpers import save_tiny_hf


def _tiny_dir(where):
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_tiny_hf(where, max_position_embeddings=512)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1",
        "chat_template": "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"}))


def test_the_second_start_runs_the_graphs_the_first_run_built_in_the_background(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    try:
        _first_and_second_start(tmp_path, monkeypatch)
    finally:
        torch.set_num_threads(threads)  # start(threads=1) sets the process's


def _first_and_second_start(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    _tiny_dir(model_dir)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(background.BACKGROUND_ENV, "1")
    config = RuntimeConfig(model=str(model_dir), dtype="float64", kernels="static", threads=1)
    assert config.stored_graphs  # the library's default, as generate's
    spec = DecoderSpec(speculative=False)
    prompt = [(7 * i) % 90 + 5 for i in range(20)]
    options = GenerateOptions(max_new_tokens=12, stop_token_ids=())

    first = start(config)
    assert first.compiled is None and "stays eager" in first.compile_reason
    decoder = build_decoder(spec, first)
    eager = Engine(first.loaded.model, first.loaded.tokenizer, decoder.decode).generate(prompt, options).token_ids
    built = build_missing(first, spec, decoder.config, len(prompt) + 12)
    assert built is not None and built.pid is not None, built
    _, status = os.waitpid(built.pid, 0)  # the detached build is this process's child
    assert os.waitstatus_to_exitcode(status) == 0, built.log.read_text() if built.log else ""

    second = start(config)
    assert second.compiled is not None and "graphs stored" in second.compile_reason
    decoder = build_decoder(spec, second)
    again = Engine(second.loaded.model, second.loaded.tokenizer, decoder.decode).generate(prompt, options).token_ids
    assert second.compiled.loaded and not second.compiled.eager  # every step ran a stored graph
    assert again == eager
    assert build_missing(second, spec, decoder.config, len(prompt) + 12) is None  # nothing left to build
