"""Local concurrency benchmark: the prompts through continuous batching in this process, a closed
loop of ``concurrency`` requests in flight (a new one joins as one finishes), per spec policy.
The same quantities ``bench --endpoint`` measures over HTTP (total and per-request tok/s, TTFT,
TPOT), without the server: what batching itself gives, e.g. for ``data build``.

``measure_batched(session, decoder, prompt_ids, max_new_tokens, concurrency, policy)`` -> a dict row; its
``outputs`` (every prompt's generated token ids) let a caller check that batching changed no token
(``same_outputs``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.profiler import SpecProfile
from specdecode.core.requests import GenerateOptions
from specdecode.core.specpolicy import SpecPolicyName
from specdecode.runtime.decoders import Decoder
from specdecode.runtime.session import Session


def measure_batched(session: Session, decoder: Decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                    concurrency: int, policy: SpecPolicyName,
                    on_done: Callable[[], None] | None = None) -> dict[str, Any]:
    """One closed-loop run; greedy; every request's time counts from when it joined the batch."""
    loaded = session.loaded
    drafter = getattr(decoder.decode, "drafter", None)
    engine = BatchEngine(loaded.model, loaded.tokenizer, drafter, decoder.config,
                         BatchConfig(slots=concurrency, spec_policy=policy, prefix_cache=0),  # steps, not reuse
                         runner=decoder.decode.runner, budget=decoder.decode.budget)
    engine.allocate()
    # compiled steps: every graph these requests can meet, built or loaded now (else the first run at a
    # new span timed the compiler, not the step); eager steps: nothing
    engine.warm(max(len(p) for p in prompt_ids) + max_new_tokens)
    engine.calibrate(prompt_ids[0])  # 'auto' fixes its choice per batch size first (untimed), as serve does
    options = GenerateOptions(max_new_tokens)
    joined: dict[int, float] = {}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    outputs: list[list[int]] = [[] for _ in prompt_ids]
    profile = SpecProfile()
    steps = rows = spec_steps = 0
    decode_s = prefill_s = 0.0  # inside engine.step(): the decode steps, and the rest (prefill chunks, release)
    queue = list(range(len(prompt_ids)))
    t0 = time.perf_counter()
    while queue or engine.active:
        while queue and engine.free_slots:
            i = queue.pop(0)
            joined[i] = time.perf_counter()
            engine.add(i, prompt_ids[i], options)
        before = time.perf_counter()
        report = engine.step()
        now = time.perf_counter()
        decode_s += report.seconds
        prefill_s += now - before - report.seconds
        if report.batch:
            steps, rows, spec_steps = steps + 1, rows + report.batch, spec_steps + report.speculative
        for record in report.cycles:
            profile.add(record)
        for key, chunk in report.events:
            i = cast(int, key)  # keys are prompt indices
            if chunk.token_ids and i not in first:
                first[i] = now
            outputs[i].extend(chunk.token_ids)
        for done in report.finished:
            ended[cast(int, done.key)] = now
            if on_done:
                on_done()
    wall = time.perf_counter() - t0
    tokens = [len(out) for out in outputs]
    latency = [ended[i] - joined[i] for i in ended]
    ttft = [first[i] - joined[i] for i in ended]
    tpot = [(ended[i] - first[i]) / (tokens[i] - 1) for i in ended if tokens[i] > 1]
    return {
        "policy": engine.policy.name, "concurrency": concurrency, "requests": len(prompt_ids),
        "completion_tokens": sum(tokens), "wall_s": wall, "output_tok_per_s": sum(tokens) / wall,
        "request_tok_per_s_median": statistics.median(t / lat for t, lat in zip(tokens, latency, strict=True)),
        "ttft_ms_median": 1000 * statistics.median(ttft), "tpot_ms_median": 1000 * statistics.median(tpot),
        "batch_mean": rows / steps if steps else 0.0, "spec_step_share": spec_steps / steps if steps else 0.0,
        # where the wall time went: decode steps (ms each, at the mean batch), prefill chunks (with the
        # step's bookkeeping), and the loop outside engine.step() (admitting requests, reading events)
        "step_ms_mean": 1000 * decode_s / steps if steps else 0.0,
        "decode_share": decode_s / wall, "prefill_share": prefill_s / wall,
        "accept_length": profile.accept_length if profile.cycles else None,
        "policy_rates": engine.policy.to_dict(), "outputs": outputs,
    }


def same_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> str:
    """"k/n": prompts whose generated token ids are identical in two runs over the same prompts."""
    if len(a) != len(b):
        raise ValueError(f"runs over different prompt sets ({len(a)} and {len(b)} prompts) cannot be compared")
    return f"{sum(list(x) == list(y) for x, y in zip(a, b, strict=True))}/{len(a)}"
