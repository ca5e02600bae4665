"""`specdecode serve`'s app: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events with ``stream: true``), ``GET /health``, ``GET /metrics`` (Prometheus).

The model is not thread-safe, so one worker thread (``scheduler``) generates for every admitted
request as one batch per step (continuous batching), taking waiting requests first come, first
served; the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.compiled import CompiledRunner
from specdecode.core.engine import TokenDecoder
from specdecode.core.specpolicy import CALIBRATION_ROUNDS, CALIBRATION_SPREAD, SpecPolicyName
from specdecode.io.loading import LoadedModel
from specdecode.serving.config import DEFAULT_COMPILE_MAX_LEN, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED
from specdecode.serving.errors import CLIENT_CLOSED, APIError, install_error_handlers, shutting_down
from specdecode.serving.handlers import ServerState, generate
from specdecode.serving.metrics import Metrics, report_periodically
from specdecode.serving.mirror import MirroredBatcher
from specdecode.serving.responses import COUNT_KEY, EVENT_STREAM
from specdecode.serving.scheduler import Batcher, Scheduler

log = logging.getLogger(__name__)
DEFAULT_BATCH = BatchConfig()
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


def _is_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(EVENT_STREAM.encode()) for k, v in start["headers"])


class _CountRequests:
    """ASGI middleware: requests by route and status, counted when the status is sent (so a client
    that has read a response always finds it in /metrics). A stream's 200 says only that it began:
    it is counted by its outcome instead, through ``scope[COUNT_KEY]`` (``responses.stream_events``
    calls it before its last event), and as 499 when it ends without one (the client left)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.count_request(route, status)

        scope[COUNT_KEY] = count

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start" and not _is_stream(message):
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:  # the app's catch-all answers 500 outside this middleware
            count(500)
            raise
        finally:
            count(CLIENT_CLOSED)  # a stream that ended without its last event


# The prompt every calibration row decodes (greedy) while --spec-policy auto times both modes per batch size.
CALIBRATION_CHAT = [{"role": "user", "content": "Explain in a few sentences how a bicycle stays upright."}]


def _warm(batcher: BatchEngine, max_len: int | None) -> None:
    """Compiled steps: every decode-step graph of the pool loaded (or, --compile on, built) now, for
    contexts up to ``max_len``; then nothing more compiles while serving (a shape not warmed runs eager:
    on 2 CPU cores a target graph takes about 35 s to build, which every running request would wait)."""
    steps = batcher.runner
    if not isinstance(steps, CompiledRunner):
        return
    t0 = time.perf_counter()
    loaded0, eager0 = len(steps.loaded), len(steps.eager)
    log.info("compiled steps: %s graphs for batches of up to %d requests, contexts up to %d tokens ...",
             "building or loading" if steps.build else "loading the stored", batcher.config.slots,
             min(max_len or batcher.limit, batcher.limit))
    built = batcher.warm(max_len, seal=True)
    loaded = len(steps.loaded) - loaded0
    eager = len(steps.eager) - eager0
    log.info("compiled steps (%.1f s): %d graphs built, %d loaded, %d shapes eager%s; longer contexts and prefill "
             "run eager", time.perf_counter() - t0, built, loaded, eager,
             " (not stored: built in the background once the server is ready, for its next start; "
             "`specdecode compile --serve` with these flags builds them in the foreground)" if eager else "")
    if batcher.mixed_steps:
        log.warning("some batch sizes have stored graphs and others not, and a graph rounds bf16 otherwise than an "
                    "eager step, so a request's tokens would depend on its batch: every step runs eager until a start "
                    "finds them all stored")


def _prepare(batcher: BatchEngine, calibration_ids: list[int], compile_max_len: int | None,
             on_ready: Callable[[], None] | None = None) -> None:
    """Before the first request (which waits meanwhile): the compiled graphs, then the policy's timing, then
    ``on_ready`` (``serve``: the build of the graphs that were not stored, in the background)."""
    try:
        _warm(batcher, compile_max_len)
    except Exception:  # the server goes on with what was warmed; nothing more compiles while serving
        log.exception("compiling the steps failed: every step runs eager (a mix of graphs and eager steps would make "
                      "a request's tokens depend on its batch)")
        if isinstance(batcher.runner, CompiledRunner):
            batcher.runner.build = False
            batcher.run_eager()
    if batcher.policy.name == "auto":
        _calibrate(batcher, calibration_ids)
    if on_ready is not None:
        on_ready()


def _calibrate(batcher: BatchEngine, prompt_ids: list[int]) -> None:
    t0 = time.perf_counter()
    log.info("spec policy auto: timing plain and speculative steps per batch size before serving ...")
    chosen = batcher.calibrate(prompt_ids)
    rates = batcher.policy.calibrated_rates
    log.info("spec policy auto (%.1f s): %s", time.perf_counter() - t0, ", ".join(
        f"batch {b}: {'speculative' if spec else 'plain'} "
        f"(speculative {rates[b][0]:.0f}, plain {rates[b][1]:.0f} tok/s)"
        for b, spec in sorted(chosen.items())))
    disturbed = {b: x for b, x in batcher.policy.calibrated_spread.items() if x > CALIBRATION_SPREAD}
    if disturbed:
        log.warning("spec policy auto: the CPU was busy while timing (batch %s: a step's median %s its fastest, "
                    "after %d rounds); the choice may not hold once it is idle: restart the server then, or "
                    "choose the mode (--spec-policy always or never)", ", ".join(map(str, disturbed)),
                    ", ".join(f"{x:.1f}x" for x in disturbed.values()), CALIBRATION_ROUNDS)


def make_batcher(loaded: LoadedModel, decoder: TokenDecoder, batch: BatchConfig, ranks: int = 1) -> BatchEngine:
    """The batch engine a server runs (every rank its own under tensor parallelism, in lockstep: the spec policy
    is then fixed, since a mode timed on one rank could differ on another)."""
    if ranks > 1 and batch.spec_policy not in ("always", "never"):
        policy: SpecPolicyName = "never" if decoder.spec is None else "always"
        log.info("tensor parallel: spec policy %s (every rank must take the same mode each step)", policy)
        batch = replace(batch, spec_policy=policy)
    return BatchEngine(loaded.model, loaded.tokenizer, decoder.drafter, decoder.spec, batch, adapt=None,
                       sync=decoder.sync, comm=decoder.comm, runner=decoder.runner, budget=decoder.budget)


def create_app(loaded: LoadedModel, decoder: TokenDecoder, served_model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queued: int = DEFAULT_MAX_QUEUED,
               log_interval_s: float = 10.0, shutdown_wait_s: float = 10.0, ranks: int = 1,
               batch: BatchConfig = DEFAULT_BATCH, compile_max_len: int | None = DEFAULT_COMPILE_MAX_LEN,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app around one model and decoder; the worker starts with the app's lifespan. Requests
    run batched (``batch``: slots, tokens per slot, prefill chunk, spec policy), the compiled graphs loaded
    or built first (``compile_max_len``), then ``on_ready`` called, before the first request. ``ranks`` > 1:
    rank 0 of a tensor-parallel group, whose other ranks mirror its batch (``serving.mirror``)."""
    model = loaded.model
    metrics = Metrics(max_depth=decoder.max_depth)
    engine = make_batcher(loaded, decoder, batch, ranks)
    batcher: Batcher = MirroredBatcher(engine) if ranks > 1 else engine
    calibration_ids = loaded.tokenizer.encode_chat(CALIBRATION_CHAT)
    engine.check_calibration(len(calibration_ids))  # before serving, not a failure behind a healthy /health
    prepare = partial(_prepare, engine, calibration_ids, compile_max_len, on_ready)
    log.info("continuous batching: up to %d requests of %d tokens, KV pool %.2f GB, prefix cache %d tokens "
             "(%.2f GB), spec policy %s", batch.slots, engine.limit, engine.pool_bytes() / 1e9,
             engine.prefix_tokens, engine.prefix_bytes() / 1e9, engine.policy.name)
    state = ServerState(
        scheduler=Scheduler(batcher, metrics, max_queued, prepare),
        metrics=metrics,
        # Request parsing runs on the event loop while the worker decodes: separate
        # tokenizer objects keep the two threads from sharing one Rust tokenizer.
        tokenizer=copy.deepcopy(loaded.tokenizer),
        model_name=served_model_name,
        vocab_size=model.config.vocab_size,
        context=engine.limit,
        margin=engine.margin,
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        reporter = asyncio.ensure_future(report_periodically(state.metrics, state.scheduler.load, log_interval_s))
        try:
            yield
        finally:
            reporter.cancel()
            state.scheduler.close()
            await asyncio.to_thread(state.scheduler.join, shutdown_wait_s)

    # No /docs or /openapi.json: every route but /health sits behind the API key.
    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(_CountRequests, metrics=metrics)
    install_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    async def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    protected = [Depends(require_key)]

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "specdecode"}

    @app.get("/health")
    async def health():
        if state.scheduler.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not state.scheduler.ready:  # a load balancer sends nothing yet; a request sent anyway waits in the queue
            return JSONResponse({"status": "starting: loading compiled graphs and timing the spec policy"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=protected)
    async def metrics():
        text = state.metrics.render(*state.scheduler.load())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=protected)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request):
        return await generate(request, state, chat=False)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        return await generate(request, state, chat=True)


class _GracefulServer(uvicorn.Server):
    """A drain before uvicorn's shutdown. At the first SIGTERM/SIGINT the scheduler closes: queued
    requests get 503 with Retry-After at once (streams included: their status waits for the batch),
    new ones too, /health answers 503 "shutting down", and the port stays open so a load balancer
    sees that instead of a refused connection. When the running requests have finished (or
    ``drain_s`` has passed) uvicorn's own shutdown runs: it stops listening, waits for open
    connections, then the app's lifespan ends. A second signal skips the drain (uvicorn's own
    handling: SIGINT twice forces the exit)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_s: float) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_s = drain_s
        self.draining: tuple[int, float] | None = None  # (signal, when the drain began)

    def handle_exit(self, sig, frame) -> None:
        if self.draining is None and not self.should_exit:
            self.draining = (sig, time.monotonic())
            self.scheduler.close_soon()
            log.info("shutting down: no new requests; waiting up to %.0f s for the running ones", self.drain_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.draining is not None and not self.should_exit:
            sig, since = self.draining
            running, queued = self.scheduler.load()
            if running == 0 and queued == 0:
                super().handle_exit(sig, None)
            elif time.monotonic() - since >= self.drain_s:
                log.warning("shutting down: %d requests still running after %.0f s; ending them with an error",
                            running, self.drain_s)
                self.scheduler.abort_running(shutting_down(
                    f"the server shut down before the request finished (it waits {self.drain_s:.0f} s)"))
                super().handle_exit(sig, None)
        return await super().on_tick(counter)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout_s: float = 30.0,
                log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``create_app``'s app (port 0: any free port)."""
    # uvicorn waits float seconds (asyncio.wait_for) though its annotation says int
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s)  # type: ignore[arg-type]
    return _GracefulServer(config, app.state.server.scheduler, shutdown_timeout_s)
