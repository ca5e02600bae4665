"""The worker: one thread generates for one request at a time, first come, first served.

It steps ``Engine.stream`` chunk by chunk and hands every chunk to the request's asyncio
queue (``call_soon_threadsafe``): the event loop never waits on the model, and a request
whose client went away is dropped at the next chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field

from specdecode.core.engine import Engine, GenerateOptions, StreamChunk
from specdecode.serving.config import DEFAULT_MAX_QUEUED
from specdecode.serving.errors import APIError, shutting_down
from specdecode.serving.metrics import Metrics

log = logging.getLogger(__name__)

END = object()  # the last event of every job


@dataclass(eq=False)  # identity equality: jobs are removed from the queue by identity
class Job:
    """One generation: the worker posts StreamChunks, maybe an APIError, then END to ``events``."""

    prompt_ids: list[int]
    options: GenerateOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    accepted_at: float = field(default_factory=time.perf_counter)

    def post(self, event: object) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        while (event := await self.events.get()) is not END:
            if isinstance(event, APIError):
                raise event
            yield event


class Scheduler:
    """One worker thread, a FIFO of waiting jobs, and the shutdown sequence."""

    def __init__(self, engine: Engine, metrics: Metrics, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queued = max_queued
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._work, name="specdecode-worker", daemon=True)

    @property
    def closing(self) -> bool:
        return self._closing

    def load(self) -> tuple[int, int]:
        """(running, queued)."""
        return int(self._running is not None), len(self._waiting)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def submit(self, prompt_ids: list[int], options: GenerateOptions) -> Job:
        job = Job(prompt_ids, options, asyncio.get_running_loop())
        with self._cv:
            if self._closing:
                raise shutting_down()
            if len(self._waiting) >= self.max_queued:
                raise APIError(503, f"the server is overloaded ({len(self._waiting)} requests queued); retry later",
                               type="server_error", code="overloaded")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job: taken off the queue, or stopped by the worker at its next chunk."""
        job.cancelled.set()
        with self._cv, contextlib.suppress(ValueError):
            self._waiting.remove(job)

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

    def close_soon(self) -> None:
        """``close`` from any thread, signal handlers included (they must not take locks)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cv:
            while not self._waiting and not self._closing:
                self._cv.wait()
            if not self._waiting:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _work(self) -> None:
        while (job := self._next()) is not None:
            if not job.cancelled.is_set():  # else its client left while it waited: skip the prefill
                self._generate(job)
            with self._cv:
                self._running = None
            job.post(END)  # after the bookkeeping: a client that saw its end finds the worker idle

    def _generate(self, job: Job) -> None:
        self.metrics.count_prompt(len(job.prompt_ids))
        stream = self.engine.stream(job.prompt_ids, job.options, self.metrics.spec)
        last = None  # when the previous tokens came
        try:
            for chunk in stream:
                if job.cancelled.is_set():
                    return
                if chunk.token_ids:
                    now = time.perf_counter()
                    per_token = None if last is None else (now - last) / len(chunk.token_ids)
                    ttft = now - job.accepted_at if last is None else None
                    self.metrics.count_tokens(len(chunk.token_ids), ttft, per_token)
                    last = now
                job.post(chunk)  # after counting, so /metrics never lags what a client saw
        except Exception:  # a bug or a device failure: this request fails, the server goes on
            log.exception("generation failed")
            job.post(APIError(500, "generation failed; see the server log", type="server_error"))
        finally:
            if isinstance(stream, Generator):  # Engine.stream's is: close it so its cleanup runs now
                stream.close()
