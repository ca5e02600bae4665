"""Generation: token decoders (pure generators of token chunks) and the text layer on top.

A *decoder* is a generator of ``DecodeStep``s: the baseline yields one token per target
forward, a speculative decoder yields every token accepted in a cycle together with the
cycle's record (counts and phase times), which the engine aggregates.
``Engine`` adds what is common to both: stop tokens, stop strings, max tokens, streaming
text and timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdecode.core.model import Transformer
from specdecode.core.profiler import CycleRecord, SpecProfile, TimeMeter
from specdecode.core.sampling import SamplingParams, sample


@dataclass
class DecodeStep:
    tokens: list[int]  # new tokens, in order
    cycle: CycleRecord | None = None  # speculative cycles only
    prefill_s: float | None = None  # set on the first step of a speculative decoder


class TokenDecoder(Protocol):
    """A decoder: ``decoder(model, prompt_ids, max_new_tokens, sampling, generator)`` gives a
    generator of ``DecodeStep``s (closed by the engine when it stops early). ``baseline_decode``
    and ``Eagle3Decoder`` are two; ``generator`` is None for greedy decoding."""

    def __call__(self, model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams, generator: torch.Generator | None, /
                 ) -> Generator[DecodeStep, None, None]: ...


class Tokenizer(Protocol):
    """What generation needs of a tokenizer (``specdecode.io.tokenizer.Tokenizer`` is one)."""

    eos_token_ids: tuple[int, ...]

    def decode(self, ids: Sequence[int]) -> str: ...


class ContextLengthError(ValueError):
    """The prompt plus the requested new tokens do not fit the model's context."""


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's EOS ids

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class StreamChunk:
    token_ids: list[int]  # new tokens in this chunk
    text: str  # new text released in this chunk (held back while a stop string may begin)
    finish_reason: str | None = None  # "stop" | "length" on the last chunk


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    elapsed_s: float
    ttft_s: float
    stats: dict[str, Any] = field(default_factory=dict)  # decoder-specific (speculative counters, phases)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "num_tokens": self.num_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "elapsed_s": self.elapsed_s,
            "ttft_s": self.ttft_s,
            "tok_per_s": self.tok_per_s,
            **self.stats,
        }


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int, margin: int = 0) -> int:
    """Cache size for a request, or a ContextLengthError with the numbers."""
    need = prompt_len + max_new_tokens + margin
    limit = model.config.max_position_embeddings
    if prompt_len < 1:
        raise ValueError("the prompt is empty: at least one token is needed")
    if need > limit:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens})"
            + (f" + {margin} speculative slots" if margin else "")
            + f" = {need} exceeds the model context of {limit} tokens"
        )
    return need


class BaselineDecoder:
    """Plain autoregressive decoding: one target forward per token (``baseline_decode`` is the
    instance). No drafter and no shape: continuous batching runs it as plain batched steps."""

    drafter: None = None
    spec: None = None

    @torch.inference_mode()
    def __call__(self, model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                 sampling: SamplingParams, generator: torch.Generator | None = None
                 ) -> Generator[DecodeStep, None, None]:
        cache = model.new_cache(1, check_context(model, len(prompt_ids), max_new_tokens))
        device = model.device
        tokens = torch.tensor([list(prompt_ids)], device=device)
        positions = torch.arange(len(prompt_ids), device=device)
        logits = model(tokens, positions, cache, logits_at=torch.tensor([-1], device=device)).logits
        for _ in range(max_new_tokens):
            token = sample(logits[0, -1], sampling, generator)
            yield DecodeStep([int(token)])
            position = torch.tensor([cache.length], device=device)
            logits = model(token.view(1, 1), position, cache).logits


baseline_decode = BaselineDecoder()


class TextAssembler:
    """Incremental detokenization with stop tokens, stop strings and a token budget.

    Text that might be the start of a stop string, or an incomplete UTF-8 sequence,
    is held back until it is resolved.
    """

    def __init__(self, tokenizer: Tokenizer, options: GenerateOptions) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in options.stop if s)
        self.stop_ids = set(tokenizer.eos_token_ids if options.stop_token_ids is None
                            else options.stop_token_ids)
        self.max_new_tokens = options.max_new_tokens
        self.token_ids: list[int] = []
        self.text_ids: list[int] = []  # token_ids minus a final stop token
        self.text = ""  # text released so far
        self.finish_reason: str | None = None

    def add(self, new_ids: list[int]) -> StreamChunk:
        taken: list[int] = []
        for tok in new_ids:
            if self.finish_reason:
                break
            taken.append(tok)
            self.token_ids.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.text_ids.append(tok)
            if len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        full = self.tokenizer.decode(self.text_ids)
        cut = self._find_stop(full)
        if cut is not None:
            full, self.finish_reason = full[:cut], "stop"
        release = len(full) if self.finish_reason else self._safe_length(full)
        delta = full[len(self.text):release] if release > len(self.text) else ""
        self.text += delta
        return StreamChunk(taken, delta, self.finish_reason)

    def _find_stop(self, full: str) -> int | None:
        # Only text after what was already released can hold a new match.
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _safe_length(self, full: str) -> int:
        end = len(full)
        while end > len(self.text) and full[end - 1] == "\ufffd":  # partial UTF-8 sequence
            end -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if full[:end].endswith(s[:k]):
                    end = min(end, len(full[:end]) - k)
                    break
        return end


class Engine:
    """Generation over one model and tokenizer with a pluggable token decoder."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer,
                 decoder: TokenDecoder = baseline_decode, comm: TimeMeter | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.comm = comm  # tensor parallelism: time in all-reduces, reported per token

    def stream(self, prompt_ids: Sequence[int], options: GenerateOptions = GenerateOptions(),
               profile: SpecProfile | None = None) -> Iterator[StreamChunk]:
        """Chunks of new tokens and text; speculative cycles are added to ``profile``."""
        text = TextAssembler(self.tokenizer, options)
        generator = None if options.sampling.greedy else options.sampling.make_generator(self.model.device)
        steps = self.decoder(self.model, prompt_ids, options.max_new_tokens, options.sampling, generator)
        try:
            for step in steps:
                if profile is not None:
                    if step.cycle is not None:
                        profile.add(step.cycle)
                    if step.prefill_s is not None:
                        profile.prefill_s += step.prefill_s
                chunk = text.add(step.tokens)
                yield chunk
                if chunk.finish_reason:
                    return
            yield StreamChunk([], "", text.finish_reason or "length")
        finally:
            steps.close()

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
            depth: int = getattr(self.decoder, "max_depth", profile.max_depth)
            stats = profile.to_dict(depth)
        if self.comm:  # tensor parallel: the share of time spent in all-reduces
            comm = self.comm.seconds - comm0
            stats["allreduce_ms_per_token"] = 1000 * comm / max(len(ids), 1)
            stats["allreduce_share"] = comm / max(elapsed, 1e-12)
        return GenerationResult("".join(text), ids, len(prompt_ids), finish, elapsed,
                                ttft if ttft is not None else elapsed, stats)
