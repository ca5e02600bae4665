"""The worker: one thread runs every admitted request as one batch per step (continuous
batching, ``core.batching.BatchEngine``), taking waiting requests first come, first served
into free slots between steps.

It hands every chunk to its request's asyncio queue (``call_soon_threadsafe``): the event loop
never waits on the model. A request whose client went away leaves the batch before the next
step, freeing its slot at once. Waiting requests are bounded (``max_queued``): beyond that a
503 with ``Retry-After`` says when to come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from specdecode.core.batching import Finished, StepReport
from specdecode.core.profiler import SpecProfile
from specdecode.core.requests import GenerateOptions, StreamChunk
from specdecode.serving.config import DEFAULT_MAX_QUEUED
from specdecode.serving.errors import APIError, shutting_down
from specdecode.serving.metrics import Metrics

log = logging.getLogger(__name__)

END = object()  # the last event of every job
STARTED = object()  # posted when a job joins the batch, before its first chunk


@dataclass(eq=False)  # identity equality: jobs are removed from the queue by identity
class Job:
    """One generation: the worker posts StreamChunks, maybe an APIError, then END to ``events``."""

    prompt_ids: list[int]
    options: GenerateOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    accepted_at: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (set by the worker before STARTED)
    last_token_at: float | None = None  # when its previous tokens were delivered (worker thread)
    profile: SpecProfile | None = None  # its speculative cycles (set by the worker before END)

    def post(self, event: object) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def started(self) -> None:
        """Wait until the job joins the batch; a job refused before it started (the server shutting
        down, a request that could not join) raises its APIError here, while a stream can still
        answer with its status (503, 500) instead of an in-band error after a 200."""
        while (event := await self.events.get()) is not STARTED:
            if isinstance(event, APIError):
                raise event
            if event is END:
                raise APIError(500, "the request ended before it started; see the server log", type="server_error")

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        while (event := await self.events.get()) is not END:
            if isinstance(event, APIError):
                raise event
            if event is not STARTED:
                yield event


class Batcher(Protocol):
    """What the worker drives: ``core.batching.BatchEngine``, or under tensor parallelism rank 0's
    ``serving.mirror.MirroredBatcher`` around one."""

    @property
    def active(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    def allocate(self) -> None: ...

    def add(self, key: Hashable, prompt_ids: Sequence[int], options: GenerateOptions) -> int:
        """Returns the prompt tokens found in a prefix cache (0: none, or no cache)."""
        ...

    def remove(self, key: Hashable) -> Finished | None: ...

    def step(self) -> StepReport: ...


class Scheduler:
    """One worker thread running a ``Batcher``, a bounded FIFO of waiting jobs, and the shutdown
    sequence."""

    def __init__(self, batcher: Batcher, metrics: Metrics, max_queued: int = DEFAULT_MAX_QUEUED,
                 prepare: Callable[[], None] | None = None) -> None:
        self.batcher = batcher
        self.prepare = prepare  # run on the worker thread before the first request (spec policy calibration)
        self.metrics = metrics
        self.max_queued = max_queued
        self.slots = batcher.free_slots  # requests decoded together (read once: the worker owns the batcher)
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # id(job) -> job, admitted into the batch
        self._gone: list[Job] = []  # running jobs whose clients left: removed before the next step
        self._request_s = 0.0  # moving average of a request's time in the batch (for Retry-After)
        self._closing = False
        self._abort: APIError | None = None  # set when a drain times out: every running job ends with it
        self._ready = threading.Event()  # set once ``prepare`` has run: /health says "starting" until then
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._work, name="specdecode-worker", daemon=True)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def ready(self) -> bool:
        """Prepared (compiled graphs loaded, spec policy timed): requests no longer wait for that."""
        return self._ready.is_set()

    def load(self) -> tuple[int, int]:
        """(running, queued)."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, prompt_ids: list[int], options: GenerateOptions) -> Job:
        job = Job(prompt_ids, options, asyncio.get_running_loop())
        with self._cv:
            if self._closing:
                raise shutting_down()
            # free slots the worker has not filled yet take waiting jobs too: a burst is refused only past
            # slots + max_queued (counting queued alone refused the 5th of a burst with a slot still free)
            if len(self._waiting) >= self.max_queued + max(0, self.slots - len(self._running)):
                wait = self.retry_after_s()
                raise APIError(503, f"the server is overloaded ({len(self._running)} requests running, "
                                    f"{len(self._waiting)} queued, the most it queues); retry in about {wait} s",
                               type="server_error", code="overloaded", headers={"Retry-After": str(wait)})
            self._waiting.append(job)
            self._cv.notify()
        return job

    def retry_after_s(self) -> int:
        """Seconds until the queue has room again, about: the queued requests over the running
        ones, times a request's measured time in the batch (1 s before any finished)."""
        rounds = (len(self._waiting) + 1) / max(len(self._running), 1)
        return max(1, min(600, math.ceil(rounds * (self._request_s or 1.0))))

    def cancel(self, job: Job) -> None:
        """Drop a job: taken off the queue, or out of the batch before the worker's next step."""
        job.cancelled.set()
        with self._cv:
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
            if id(job) in self._running:
                self._gone.append(job)
                self._cv.notify()

    def close(self) -> None:
        """Take no new jobs and fail the waiting ones; the running one finishes."""
        with self._cv:
            self._closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        for job in dropped:
            job.post(shutting_down("the server is shutting down; the request was not started"))
            job.post(END)

    def abort_running(self, error: APIError) -> None:
        """End every running job with ``error`` and then END, before the worker's next step (a drain
        that timed out: each stream gets an error event and [DONE], not a cut connection)."""
        with self._cv:
            self._abort = error
            self._cv.notify()

    def close_soon(self) -> None:
        """``close`` from any thread, signal handlers included (they must not take locks)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _admit(self) -> tuple[list[Job], list[Job]] | None:
        """Under the lock: wait for work; take leaving jobs out and waiting ones in. None: stop."""
        with self._cv:
            while not self._waiting and not self._running and not self._closing:
                self._cv.wait()
            if not self._waiting and not self._running:
                return None
            if self._abort is not None:
                for job in self._running.values():
                    job.post(self._abort)  # before the END the loop below posts
                    self._gone.append(job)
                self._abort = None
            gone, self._gone = self._gone, []
            for job in gone:
                self._running.pop(id(job), None)
            joined: list[Job] = []
            while self._waiting and self.batcher.free_slots - len(joined) + len(gone) > 0:
                job = self._waiting.popleft()
                if not job.cancelled.is_set():  # else its client left while it waited: skip the prefill
                    self._running[id(job)] = job
                    joined.append(job)
                else:
                    job.post(END)
            return gone, joined

    def _work(self) -> None:
        self.batcher.allocate()  # on this thread: see BatchEngine.allocate
        if self.prepare is not None:
            try:
                self.prepare()  # requests arriving meanwhile wait in the queue
            except Exception:  # a failed calibration leaves the policy's default; the server goes on
                log.exception("preparing the batch (spec policy calibration) failed")
        self._ready.set()
        while (admitted := self._admit()) is not None:
            gone, joined = admitted
            for job in gone:
                self.batcher.remove(id(job))
                job.post(END)
            for job in joined:
                try:
                    job.cached_tokens = self.batcher.add(id(job), job.prompt_ids, job.options)
                    self.metrics.count_prompt(len(job.prompt_ids), job.cached_tokens)
                    job.post(STARTED)
                except Exception:  # the handlers checked the request: a bug; this request fails, not the server
                    log.exception("a request could not join the batch")
                    with self._cv:
                        self._running.pop(id(job), None)
                    job.post(APIError(500, "the request could not be started; see the server log",
                                      type="server_error"))
                    job.post(END)
            if not self.batcher.active:
                continue
            try:
                report = self.batcher.step()
            except Exception:  # a bug or a device failure: these requests fail, the server goes on
                log.exception("generation failed")
                self._fail_running()
                continue
            self._deliver(report)

    def _deliver(self, report: StepReport) -> None:
        now = time.perf_counter()
        self.metrics.count_step(report)
        for key, chunk in report.events:
            job = self._running.get(cast(int, key))  # keys are id(job)
            if job is None:
                continue
            if chunk.token_ids:
                per_token = None if job.last_token_at is None else (now - job.last_token_at) / len(chunk.token_ids)
                ttft = now - job.accepted_at if job.last_token_at is None else None
                self.metrics.count_tokens(len(chunk.token_ids), ttft, per_token)
                job.last_token_at = now
            job.post(chunk)  # after counting, so /metrics never lags what a client saw
        for done in report.finished:
            with self._cv:
                job = self._running.pop(cast(int, done.key), None)
            if job is None:
                continue
            self.metrics.count_finished(done)
            job.profile = done.profile
            seconds = now - job.accepted_at
            self._request_s = seconds if not self._request_s else 0.8 * self._request_s + 0.2 * seconds
            job.post(END)  # after the bookkeeping: a client that saw its end finds the slot free

    def _fail_running(self) -> None:
        with self._cv:
            jobs, self._running = list(self._running.values()), {}
        for job in jobs:
            self.batcher.remove(id(job))
            job.post(APIError(500, "generation failed; see the server log", type="server_error"))
            job.post(END)
