"""specdecode: fast LLM decoding with EAGLE-3 speculative decoding, and the measurements to prove it.

The public API, in one import (loaded lazily: ``import specdecode`` does not import torch)::

    from specdecode import DecoderSpec, Engine, GenerateOptions, RuntimeConfig, SamplingParams, SpecConfig
    from specdecode import build_decoder, start

    session = start(RuntimeConfig())        # the default SmolLM2-135M-Instruct, format chosen for this machine
    decoder = build_decoder(DecoderSpec(), session)              # shipped EAGLE-3 drafter, shape chosen by measurement
    engine = Engine(session.loaded.model, session.loaded.tokenizer, decoder.decode)
    ids = session.loaded.tokenizer.encode_chat("Why is the sky blue?")
    print(engine.generate(ids, GenerateOptions(max_new_tokens=64)).text)

Layers (ARCHITECTURE.md): ``core`` (torch only) < ``io`` < ``runtime`` < ``bench`` <
``training`` | ``serving`` | ``integrations`` < ``cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it (one source of truth; nothing is re-implemented here)
_EXPORTS = {
    "ModelConfig": "specdecode.core.model",
    "Transformer": "specdecode.core.model",
    "KVCache": "specdecode.core.kvcache",
    "SamplingParams": "specdecode.core.sampling",
    "Engine": "specdecode.core.engine",
    "GenerateOptions": "specdecode.core.engine",
    "GenerationResult": "specdecode.core.engine",
    "StreamChunk": "specdecode.core.engine",
    "baseline_decode": "specdecode.core.engine",
    "BatchEngine": "specdecode.core.batching",
    "BatchConfig": "specdecode.core.batching",
    "generate_all": "specdecode.core.batching",
    "SpecConfig": "specdecode.core.speculative",
    "AutoSpec": "specdecode.core.costmodel",
    "Eagle3Decoder": "specdecode.core.speculative",
    "Eagle3Drafter": "specdecode.core.drafter",
    "random_drafter": "specdecode.core.drafter",
    "check_lossless": "specdecode.core.lossless",
    "LosslessReport": "specdecode.core.lossless",
    "format_profile": "specdecode.core.profiler",
    "load_model": "specdecode.io.loading",
    "LoadedModel": "specdecode.io.loading",
    "ModelLoadError": "specdecode.io.errors",
    "DrafterMismatchError": "specdecode.io.errors",
    "load_drafter": "specdecode.io.checkpoints",
    "save_drafter": "specdecode.io.checkpoints",
    "RuntimeConfig": "specdecode.runtime.session",
    "Session": "specdecode.runtime.session",
    "start": "specdecode.runtime.session",
    "DecoderSpec": "specdecode.runtime.decoders",
    "Decoder": "specdecode.runtime.decoders",
    "build_decoder": "specdecode.runtime.decoders",
    "build_missing": "specdecode.runtime.builds",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

