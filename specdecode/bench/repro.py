"""Reproducibility, measured: does the same request give the same tokens when it is repeated, when
it is batched with others, and when it is decoded speculatively instead of plainly?

Everything goes through the server's machinery (``core.batching``'s continuous batching): a
request alone is a batch of one slot; batched, ``ReproConfig.batch`` slots take the prompts as they
come (rows join as others finish, so each request meets changing neighbours). Each check is run per
decoding mode (plain steps, as ``--spec-policy never``; speculative steps, as ``always``).

The checks in detail: docs/measuring.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from specdecode.core.batching import BatchConfig, generate_all
from specdecode.core.model import Transformer
from specdecode.core.requests import GenerateOptions
from specdecode.core.runner import EAGER, Drafter, StepRunner
from specdecode.core.sampling import SamplingParams
from specdecode.core.specpolicy import SpecPolicyName
from specdecode.core.speculative import SpecConfig


@dataclass(frozen=True)
class ReproConfig:
    max_new_tokens: int = 64
    repeats: int = 3  # greedy runs alone per prompt
    batch: int = 4  # slots in the batched run
    temperature: float = 0.8  # the seeded runs
    seed: int = 1234
    # the server's --batch-invariant: every step runs the pool's ``batch`` rows, and "alone" is a request
    # alone in such a pool (what that mode promises: the same tokens whatever else is batched)
    batch_invariant: bool = False


@dataclass
class Agreement:
    """How many prompts gave identical outputs in one comparison, and where the others first differed."""

    identical: int = 0
    prompts: int = 0
    first_difference: list[int] = field(default_factory=list)

    def add(self, a: Sequence[int], b: Sequence[int]) -> None:
        self.prompts += 1
        if list(a) == list(b):
            self.identical += 1
        else:
            self.first_difference.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                                              min(len(a), len(b))))

    def __str__(self) -> str:
        return f"{self.identical}/{self.prompts}"


@dataclass
class ModeResult:
    mode: str  # plain | speculative
    repeat: Agreement = field(default_factory=Agreement)
    seeded: Agreement = field(default_factory=Agreement)
    batched: Agreement = field(default_factory=Agreement)
    vs_plain: Agreement | None = None
    alone_tok_s: float = 0.0  # generated tokens per second of the first greedy alone pass (one request at a time)
    batched_tok_s: float = 0.0  # of the batched pass (``batch`` requests at a time)

    def as_dict(self) -> dict:
        return asdict(self)


def _runs(model: Transformer, prompts: Sequence[Sequence[int]], options: GenerateOptions, stop: Sequence[int],
          slots: int, drafter: Drafter | None, spec: SpecConfig | None, invariant: bool = False,
          one_at_a_time: bool = False, runner: StepRunner = EAGER) -> list[list[int]]:
    policy: SpecPolicyName = "never" if drafter is None else "always"
    slot_tokens = max(len(p) for p in prompts) + options.max_new_tokens + (spec.margin if spec else 0) + 1
    # no prefix cache: what changes an answer here must be the batch's company alone (one engine per run, so
    # the one-at-a-time runs would hit nothing while the batched ones share the chat template's stem)
    config = BatchConfig(slots=slots, slot_tokens=slot_tokens, spec_policy=policy, batch_invariant=invariant,
                         prefix_cache=0)
    if one_at_a_time:
        return [generate_all(model, [p], options, stop, config, drafter, spec, runner=runner)[0] for p in prompts]
    return generate_all(model, prompts, options, stop, config, drafter, spec, runner=runner)


def measure(model: Transformer, prompts: Sequence[Sequence[int]], stop_token_ids: Sequence[int],
            drafter: Drafter | None, spec: SpecConfig | None, cfg: ReproConfig = ReproConfig(),
            on_progress: Callable[[str], None] | None = None, runner: StepRunner = EAGER) -> list[ModeResult]:
    """Plain mode, then speculative mode when ``drafter`` is given (``runner``'s steps); see the module
    docstring."""
    greedy = GenerateOptions(cfg.max_new_tokens)
    seeded = GenerateOptions(cfg.max_new_tokens, SamplingParams(cfg.temperature, seed=cfg.seed))
    results: list[ModeResult] = []
    plain_alone: list[list[int]] | None = None
    # alone: a pool of one slot, or (batch invariant) one request at a time in the batch's pool
    slots = cfg.batch if cfg.batch_invariant else 1
    for mode, d, s in (("plain", None, None), ("speculative", drafter, spec)):
        if mode == "speculative" and drafter is None:
            break
        result = ModeResult(mode)
        say = on_progress or (lambda _: None)

        def alone_run(options: GenerateOptions, d: Drafter | None = d,
                      s: SpecConfig | None = s) -> list[list[int]]:
            return _runs(model, prompts, options, stop_token_ids, slots, d, s, cfg.batch_invariant, True, runner)

        say(f"{mode}: greedy alone x{cfg.repeats}")
        t0 = time.perf_counter()
        alone = [alone_run(greedy)]
        result.alone_tok_s = sum(map(len, alone[0])) / (time.perf_counter() - t0)
        alone += [alone_run(greedy) for _ in range(cfg.repeats - 1)]
        for i in range(len(prompts)):
            result.repeat.add(alone[0][i], next((run[i] for run in alone[1:] if run[i] != alone[0][i]), alone[0][i]))
        say(f"{mode}: seeded alone x2")
        first, second = alone_run(seeded), alone_run(seeded)
        for a, b in zip(first, second, strict=True):
            result.seeded.add(a, b)
        say(f"{mode}: greedy in a batch of {cfg.batch}")
        t0 = time.perf_counter()
        batched = _runs(model, prompts, greedy, stop_token_ids, cfg.batch, d, s, cfg.batch_invariant, runner=runner)
        result.batched_tok_s = sum(map(len, batched)) / (time.perf_counter() - t0)
        for a, b in zip(alone[0], batched, strict=True):
            result.batched.add(a, b)
        if plain_alone is None:
            plain_alone = alone[0]
        else:
            result.vs_plain = Agreement()
            for a, b in zip(plain_alone, alone[0], strict=True):
                result.vs_plain.add(a, b)
        results.append(result)
    return results
