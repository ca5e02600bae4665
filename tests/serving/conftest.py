"""Fixtures of the serving tests: a tiny random model with the SmolLM2 tokenizer, served by the
real uvicorn server on a loopback port, and clients for it."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from specdecode.core.batching import BatchConfig
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import baseline_decode
from specdecode.core.speculative import Eagle3Decoder
from specdecode.io.loading import LoadedModel
from specdecode.serving.app import create_app
from tests.helpers import tiny_model
from tests.serving.helpers import CONTEXT, KEY, NAME, SPEC, STEP_S, Running


@pytest.fixture(scope="module")
def tokenizer():
    from specdecode.io.loading import resolve_model_dir
    from specdecode.io.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir(None)[1])


@pytest.fixture(scope="module")
def loaded(tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other core serves HTTP and runs the clients
    model = tiny_model(seed=0, dtype=torch.float32, vocab_size=len(tokenizer.hf),
                       max_position_embeddings=CONTEXT)
    yield LoadedModel(model, tokenizer, Path("tiny"), Path("tiny"))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def decoder(loaded):
    return Eagle3Decoder(random_drafter(loaded.model, draft_vocab_size=4096, seed=0), SPEC)


@pytest.fixture(scope="module")
def server(loaded, decoder):
    # 'adaptive': plain and speculative steps mixed under load, as the tests of counters and batching need
    # (the default 'auto' calibrates once, and with this random drafter it would never speculate); prefill chunks
    # of 32 tokens: prompts of this small model's context span several, and prefix-cache hits are whole chunks
    running = Running(create_app(loaded, decoder, NAME, api_key=KEY, max_body_bytes=64 * 1024,
                                 batch=BatchConfig(spec_policy="adaptive", prefill_chunk=32)))
    yield running
    running.stop()


@pytest.fixture
def slow_server(loaded):
    """One slot (a second request queues), every forward STEP_S slower: long generations."""
    model = copy.deepcopy(loaded.model)
    model.register_forward_pre_hook(lambda *_: time.sleep(STEP_S))
    slowed = LoadedModel(model, loaded.tokenizer, loaded.source, loaded.model_dir)
    running = Running(create_app(slowed, baseline_decode, NAME, log_interval_s=0.2, batch=BatchConfig(slots=1)))
    yield running
    if running.thread.is_alive():
        running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c
