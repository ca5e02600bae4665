"""The server's counters and histograms (rendered for /metrics by ``io.prometheus``) and the
periodic decode summary in the log."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from specdecode.core.batching import Finished, StepReport
from specdecode.core.profiler import PHASES, SpecProfile
from specdecode.io.prometheus import Family, Sample, histogram_samples, render_prometheus, single

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


class Histogram:
    """A Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def family(self, name: str, help_: str) -> Family:
        return Family(name, "histogram", help_, histogram_samples(name, self.bounds, self.counts, self.sum))


@dataclass
class _SharedProfile(SpecProfile):
    """The server-wide SpecProfile: the worker adds cycles while /metrics reads it."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, record) -> None:
        with self.lock:
            super().add(record)


@dataclass(frozen=True)
class Snapshot:
    time: float
    generated: int
    cycles: int
    drafted: int
    accepted: int
    steps: int = 0  # decode steps
    step_rows: int = 0  # rows over those steps (mean batch = step_rows / steps)
    spec_steps: int = 0
    prompt: int = 0  # prompt tokens of requests started
    cached: int = 0  # of which from the prefix cache


class Metrics:
    """Counters and histograms, updated by the worker thread and the event loop alike."""

    def __init__(self, max_depth: int) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of which copied from the prefix cache
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(PER_TOKEN_BUCKETS)
        self.spec = _SharedProfile(lock=self.lock)
        self.max_depth = max_depth  # the deepest draft position a cycle can accept
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.step_tokens = Histogram(STEP_TOKEN_BUCKETS)
        self.request_accept_length = Histogram(ACCEPT_LENGTH_BUCKETS)
        self.steps: Counter[str] = Counter()  # decode steps by mode: plain | spec
        self.step_rows = 0
        self.prefill_chunks = 0

    def count_step(self, report: StepReport) -> None:
        """One step of the batch: its size, tokens, mode, speculative cycles and phase times."""
        with self.lock:
            if report.prefill_tokens:
                self.prefill_chunks += 1
            if not report.batch:
                return
            self.steps["spec" if report.speculative else "plain"] += 1
            self.step_rows += report.batch
            self.batch_size.observe(report.batch)
            self.step_tokens.observe(report.tokens)
            s = self.spec
            for record in report.cycles:
                SpecProfile.add(s, record)
            for phase, seconds in report.phases.items():
                s.phase_s[phase] = s.phase_s.get(phase, 0.0) + seconds
            if report.phases:
                s.phase_s["total"] = s.phase_s.get("total", 0.0) + report.seconds

    def count_finished(self, done: Finished) -> None:
        """A request that left the batch: its accept length, when it speculated."""
        if done.profile.cycles:
            with self.lock:
                self.request_accept_length.observe(done.profile.accept_length)

    def count_request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[route, status] += 1

    def count_prompt(self, tokens: int, cached: int = 0) -> None:
        """A request joined the batch: its prompt, of which ``cached`` tokens came from the prefix cache."""
        with self.lock:
            self.prompt_tokens += tokens
            self.cached_prompt_tokens += cached

    def count_tokens(self, tokens: int, ttft: float | None, per_token: float | None) -> None:
        with self.lock:
            self.generated_tokens += tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            if per_token is not None:
                self.per_token.observe(per_token, tokens)

    def snapshot(self) -> Snapshot:
        with self.lock:
            s = self.spec
            return Snapshot(time.perf_counter(), self.generated_tokens, s.cycles, s.drafted, s.accepted,
                            sum(self.steps.values()), self.step_rows, self.steps["spec"], self.prompt_tokens,
                            self.cached_prompt_tokens)

    def render(self, running: int, queued: int) -> str:
        """The Prometheus text exposition of every metric."""
        with self.lock:
            families = self._families(running, queued)
        return render_prometheus(families)

    def _families(self, running: int, queued: int) -> list[Family]:
        s = self.spec
        depth = max(self.max_depth, max(s.depth_hist, default=0))
        return [
            Family("specdecode_requests_total", "counter", "HTTP requests by route and status.",
                   [Sample("specdecode_requests_total", {"route": r, "status": st}, n)
                    for (r, st), n in sorted(self.requests.items())]),
            single("specdecode_requests_running", "gauge", "Requests in the batch now (prefill or decode).", running),
            single("specdecode_requests_queued", "gauge", "Requests waiting for a batch slot.", queued),
            Family("specdecode_decode_steps_total", "counter", "Batched decode steps by mode (plain or spec).",
                   [Sample("specdecode_decode_steps_total", {"mode": m}, self.steps[m]) for m in ("plain", "spec")]),
            single("specdecode_prefill_chunks_total", "counter", "Prefill chunks run (one per step at most).",
                   self.prefill_chunks),
            self.batch_size.family("specdecode_batch_size", "Requests decoded together per decode step."),
            self.step_tokens.family("specdecode_step_tokens", "Tokens generated per decode step (all requests)."),
            self.request_accept_length.family("specdecode_request_accept_length",
                                              "Accept length per finished request that speculated."),
            single("specdecode_prompt_tokens_total", "counter", "Prompt tokens of requests started.",
                   self.prompt_tokens),
            single("specdecode_prefix_cache_hit_tokens_total", "counter",
                   "Prompt tokens copied from the prefix cache instead of computed (hit rate: over prompt tokens).",
                   self.cached_prompt_tokens),
            single("specdecode_generation_tokens_total", "counter", "Tokens generated (stop tokens included).",
                   self.generated_tokens),
            self.ttft.family("specdecode_time_to_first_token_seconds",
                             "From request accepted (queue wait included) to its first token."),
            self.per_token.family("specdecode_time_per_output_token_seconds",
                                  "Time per token after the first (a chunk's wait divided among its tokens)."),
            single("specdecode_spec_cycles_total", "counter", "Speculative draft-verify cycles.", s.cycles),
            single("specdecode_spec_draft_tokens_total", "counter", "Draft tokens verified by the target.",
                   s.drafted),
            single("specdecode_spec_accepted_tokens_total", "counter",
                   "Draft tokens accepted (bonus tokens not included); accept length = 1 + accepted / cycles.",
                   s.accepted),
            Family("specdecode_spec_accepted_by_proposer_total", "counter",
                   "Draft tokens accepted by who proposed them: the drafter (eagle3), or only the n-gram copy of "
                   "the request's text (ngram; --ngram).",
                   [Sample("specdecode_spec_accepted_by_proposer_total", {"proposer": "eagle3"},
                           s.accepted - s.ngram_accepted),
                    Sample("specdecode_spec_accepted_by_proposer_total", {"proposer": "ngram"}, s.ngram_accepted)]),
            Family("specdecode_spec_draft_tokens_by_proposer_total", "counter",
                   "Draft tokens verified by who proposed them (as accepted_by_proposer).",
                   [Sample("specdecode_spec_draft_tokens_by_proposer_total", {"proposer": "eagle3"},
                           s.drafted - s.ngram_drafted),
                    Sample("specdecode_spec_draft_tokens_by_proposer_total", {"proposer": "ngram"}, s.ngram_drafted)]),
            Family("specdecode_spec_accepted_per_position_total", "counter",
                   "Cycles whose accepted path reached draft position N (1-based).",
                   [Sample("specdecode_spec_accepted_per_position_total", {"position": i},
                           sum(c for a, c in s.depth_hist.items() if a >= i)) for i in range(1, depth + 1)]),
            Family("specdecode_spec_phase_seconds_total", "counter", "Seconds spent in each phase of the cycles.",
                   [Sample("specdecode_spec_phase_seconds_total", {"phase": p}, float(s.phase_s.get(p, 0.0)))
                    for p in PHASES]),
        ]


def decode_log_line(before: Snapshot, after: Snapshot, running: int, queued: int) -> str:
    """The periodic decode summary over the interval between two snapshots (SGLang's fields:
    ``#running-req``, ``#queue-req``, ``accept len``, ``gen throughput``)."""
    seconds = max(after.time - before.time, 1e-9)
    cycles, drafted = after.cycles - before.cycles, after.drafted - before.drafted
    accepted = after.accepted - before.accepted
    steps = after.steps - before.steps
    batch = (f"batch {(after.step_rows - before.step_rows) / steps:.1f}, "
             f"spec steps {100 * (after.spec_steps - before.spec_steps) / steps:.0f}%, " if steps else "")
    spec = (f"accept len {1 + accepted / cycles:.2f}, accept rate {accepted / drafted:.2f}, "
            if cycles and drafted else "")
    prompt = after.prompt - before.prompt
    cached = f", prompt tokens {prompt} ({100 * (after.cached - before.cached) / prompt:.0f}% cached)" if prompt else ""
    return (f"decode: #running-req {running}, #queue-req {queued}, {batch}{spec}"
            f"gen throughput {(after.generated - before.generated) / seconds:.1f} tok/s{cached}")


async def report_periodically(metrics: Metrics, load: Callable[[], tuple[int, int]], interval_s: float) -> None:
    """Log ``decode_log_line`` every ``interval_s`` while busy; ``load`` gives (running, queued)."""
    before = metrics.snapshot()
    while True:
        await asyncio.sleep(interval_s)
        after = metrics.snapshot()
        running, queued = load()
        if after.generated > before.generated or running or queued:  # quiet when idle
            log.info(decode_log_line(before, after, running, queued))
        before = after
