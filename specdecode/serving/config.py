"""``ServeConfig``: how to serve (where to listen, who may call, the server's limits). Light on
purpose: the CLI reads its defaults to build ``serve``'s flags without importing the server."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.core.batching import DEFAULT_COMPILE_MAX_LEN, BatchConfig

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUED = 256
__all__ = ["DEFAULT_COMPILE_MAX_LEN", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_QUEUED", "ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # this machine only; 0.0.0.0 exposes it (then set an API key)
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on every route but /health
    served_model_name: str | None = None  # None: derived from the model's file or directory name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    max_queued: int = DEFAULT_MAX_QUEUED  # requests waiting beyond this get 503
    shutdown_timeout: float = 30.0  # seconds a shutdown waits for running requests
    log_interval: float = 10.0  # seconds between decode summaries in the log while busy
    batch: BatchConfig = field(default_factory=BatchConfig)  # continuous batching: slots, tokens, spec policy
    # compiled steps: the graphs for contexts up to this many tokens are loaded (or, --compile on, built)
    # before serving; longer contexts run eager (None: the slot limit)
    compile_max_len: int | None = DEFAULT_COMPILE_MAX_LEN
