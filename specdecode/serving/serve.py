"""Serving a started session: ``serve(session, decoder, ServeConfig(...))`` builds the app and
runs uvicorn until a signal; under tensor parallelism rank 0 listens and the others mirror it."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from functools import partial
from pathlib import Path

from specdecode.core.batching import DEFAULT_COMPILE_MAX_LEN
from specdecode.runtime.builds import build_missing
from specdecode.runtime.decoders import Decoder, DecoderSpec
from specdecode.runtime.session import Session
from specdecode.serving.app import create_app, make_batcher, make_server
from specdecode.serving.config import ServeConfig
from specdecode.serving.mirror import follow

log = logging.getLogger(__name__)


def default_model_name(source: Path) -> str:
    """'smollm2-135m-instruct' for SmolLM2-135M-Instruct.Q4_1.gguf: the file or directory
    name, lower case, without a GGUF quantization suffix."""
    name = source.stem if source.suffix.lower() == ".gguf" else source.name
    return re.sub(r"[.\-_](i?q\d\w*|bf16|f16|f32)$", "", name, flags=re.IGNORECASE).lower()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """Refuse (ValueError) an address that cannot be bound, before the model loads and is timed: a port in
    use had been found only after both. Port 0 (any free one) always binds."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed port's TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? choose --port, "
                             f"or --host)") from None


def serve(session: Session, decoder: Decoder, config: ServeConfig, spec: DecoderSpec | None = None) -> None:
    """Serve ``decoder`` over HTTP until SIGTERM/SIGINT. On ranks > 0 of a tensor-parallel
    group, run the jobs rank 0 broadcasts instead, until rank 0 shuts down. ``spec``: what ``decoder`` was
    built from; given, the graphs the server found missing at start are built in the background for the next
    start (``build_missing``)."""
    loaded = session.loaded
    name = config.served_model_name or default_model_name(loaded.source)
    if config.api_key is None and not is_loopback(config.host):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", config.host)
    ranks = session.world_size
    if session.rank > 0:  # tensor parallel: only rank 0 listens; the others mirror its batch
        follow(make_batcher(loaded, decoder.decode, config.batch, ranks))
        return
    app = create_app(loaded, decoder.decode, name, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                     max_queued=config.max_queued, log_interval_s=config.log_interval, ranks=ranks,
                     batch=config.batch, compile_max_len=config.compile_max_len,
                     on_ready=partial(_build_missing, session, decoder, config, spec) if spec is not None else None)
    log.info("format: %s, %s weights (%s)", session.config.dtype, session.config.weights, session.format_reason)
    log.info("compiled steps: %s", session.compile_reason)
    if decoder.choice is not None:
        log.info("%s", decoder.choice.summary())
    for note in decoder.notes:
        log.warning("%s", note)
    if decoder.decode.adapt is not None:
        log.warning("--adapt: continuous batching decodes every request with the first shape (%s); the shape is "
                    "re-chosen per request only when decoding one request at a time", decoder.description)
    log.info("serving %s as '%s' with %s, %s, %d threads%s", loaded.source, name, decoder.description,
             session.config.dtype, session.threads, f", tensor parallel over {ranks} ranks" if ranks > 1 else "")
    try:
        make_server(app, config.host, config.port, shutdown_timeout_s=config.shutdown_timeout).run()
    finally:
        if ranks > 1:
            app.state.server.scheduler.batcher.shutdown()


def _build_missing(session: Session, decoder: Decoder, config: ServeConfig, spec: DecoderSpec) -> None:
    """After the start-up (graphs loaded, the spec policy timed): where some step shapes had no stored graph,
    `specdecode compile --serve` with this server's settings builds them in the background, at the lowest
    priority (it takes a core only while the server leaves it idle). This server keeps the steps it started with
    (a step that changed from eager to a graph mid-life would change a repeated request's answer); the next
    start loads the graphs."""
    built = build_missing(session, spec, decoder.config, config.compile_max_len or DEFAULT_COMPILE_MAX_LEN,
                          serve=config.batch)
    if built is None:
        return
    if built.pid is None:
        log.info("compiled steps: the missing graphs are not built in the background (%s)", built.why)
        return
    log.info("compiled steps: building the missing graphs in the background at the lowest priority (pid %d, its "
             "output: %s); this server keeps its steps, and the next start with these flags loads them",
             built.pid, built.log)
