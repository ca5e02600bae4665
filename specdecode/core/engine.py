"""Generation of one request at a time: ``Engine`` turns a prompt into streamed text with what it
decodes with (``baseline_decode``, or ``core.speculative.Eagle3Decoder``). Its loop is the batch
engine's (``core.batching.BatchEngine``) over a batch of one row, so a request alone decodes exactly
as it would among others; ``Engine`` adds the request's own cache size, timing and the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.model import Transformer
from specdecode.core.profiler import SpecProfile, TimeMeter
from specdecode.core.requests import (
    GenerateOptions,
    GenerationResult,
    StreamChunk,
    Tokenizer,
    check_context,
)
from specdecode.core.runner import EAGER, StepRunner
from specdecode.core.speculative import Eagle3Decoder, SpecConfig, spec_margin


@dataclass(frozen=True)
class BaselineDecoder:
    """What an ``Engine`` decodes with: plain decoding, one target forward per token
    (``baseline_decode`` is the instance). No drafter and no shape."""

    drafter: None = None
    spec: None = None
    adapt: None = None
    sync: bool = True
    comm: None = None
    max_depth: int = 0
    runner: StepRunner = EAGER  # how steps run: eager, or compiled (runtime.decoders gives the session's)
    budget: None = None

    @property
    def shapes(self) -> list[SpecConfig]:
        return []


baseline_decode = BaselineDecoder()

TokenDecoder = BaselineDecoder | Eagle3Decoder  # what an Engine decodes with


class Engine:
    """Generation over one model and tokenizer, one request at a time, with a given decoder."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer,
                 decoder: TokenDecoder = baseline_decode, comm: TimeMeter | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.comm = comm  # tensor parallelism: time in all-reduces, reported per token

    def batch_for(self, prompt_len: int, options: GenerateOptions) -> BatchEngine:
        """A batch of one row sized for this request: its prompt, new tokens and speculative slots
        (``check_context``: a ContextLengthError with the numbers when they do not fit the model)."""
        d = self.decoder
        policy = d.adapt() if d.adapt is not None else None
        shapes = [d.spec, *(policy.shapes if policy else ())] if d.spec is not None else []
        need = check_context(prompt_len, options.max_new_tokens, self.model.config.max_position_embeddings,
                             spec_margin(shapes))
        config = BatchConfig(slots=1, slot_tokens=need, prefill_chunk=prompt_len,
                             spec_policy="never" if d.spec is None else "always", prefix_cache=0)
        return BatchEngine(self.model, self.tokenizer, d.drafter, d.spec, config, adapt=policy, sync=d.sync,
                           comm=d.comm, runner=d.runner, budget=d.budget)

    def stream(self, prompt_ids: Sequence[int], options: GenerateOptions = GenerateOptions(),
               profile: SpecProfile | None = None) -> Iterator[StreamChunk]:
        """Chunks of new tokens and text; speculative cycles are added to ``profile``."""
        batch = self.batch_for(len(prompt_ids), options)
        with torch.inference_mode():  # its caches, made here, are inference tensors as a step's inputs always were
            batch.add(0, prompt_ids, options)
        first = True
        while True:
            report = batch.step(decode=not first)  # the first token comes out before the first decode step
            first = False
            if profile is not None:
                profile.prefill_s += report.prefill_seconds
                for record in report.cycle_records():
                    profile.add(record)
            for _, chunk in report.events:
                if chunk.finish_reason and profile is not None and batch.adapt is not None:
                    profile.shape_changes = list(getattr(batch.adapt, "changes", ()))  # when, and to what
                yield chunk
                if chunk.finish_reason:
                    return

    def generate(self, prompt_ids: Sequence[int], options: GenerateOptions = GenerateOptions(),
                 on_chunk: Callable[[StreamChunk], None] | None = None) -> GenerationResult:
        t0 = time.perf_counter()
        ttft: float | None = None
        ids: list[int] = []
        text: list[str] = []
        finish = "length"
        profile = SpecProfile()
        comm0 = self.comm.seconds if self.comm else 0.0
        for chunk in self.stream(prompt_ids, options, profile):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            ids += chunk.token_ids
            text.append(chunk.text)
            if on_chunk:
                on_chunk(chunk)
            finish = chunk.finish_reason or finish
        elapsed = time.perf_counter() - t0
        stats: dict[str, Any] = {}
        if profile.cycles:
            stats = profile.to_dict(self.decoder.max_depth or profile.max_depth)
            # the decode loop's time after the first token outside the cycles (text, stop checks, the step around)
            stats["loop_ms_per_cycle"] = 1000 * max(0.0, elapsed - (ttft or 0.0) - profile.phase_s["total"]) \
                / profile.cycles
        if self.comm:  # tensor parallel: the share of time spent in all-reduces
            comm = self.comm.seconds - comm0
            stats["allreduce_ms_per_token"] = 1000 * comm / max(len(ids), 1)
            stats["allreduce_share"] = comm / max(elapsed, 1e-12)
        return GenerationResult("".join(text), ids, len(prompt_ids), finish, elapsed,
                                ttft if ttft is not None else elapsed, stats)
