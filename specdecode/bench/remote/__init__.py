"""Remote mode of the bench harness: measure any OpenAI-compatible server over streaming.

The harness sends each prompt as one streaming request (``stream: true`` with
``stream_options: {"include_usage": true}``), reads the server-sent events itself, and times
every request on the client side. It also reads the server's own speculative-decoding
metrics before and after the run and reports the difference.

More in docs/measuring.md.
"""

from specdecode.bench.remote.metrics import read_spec_snapshot, spec_delta
from specdecode.bench.remote.request import RequestResult
from specdecode.bench.remote.run import (
    RemoteError,
    RemoteRun,
    identify_server,
    likely_causes,
    list_models,
    measure_endpoint,
    normalize_endpoint,
    short_model_id,
    summarize_run,
    to_records,
)
from specdecode.bench.remote.sse import SSEDecoder

__all__ = [
    "RemoteError", "RequestResult", "RemoteRun", "measure_endpoint", "summarize_run", "to_records",
    "normalize_endpoint", "list_models", "SSEDecoder", "read_spec_snapshot", "spec_delta", "identify_server",
    "likely_causes", "short_model_id",
]
