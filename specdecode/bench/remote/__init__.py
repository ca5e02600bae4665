"""Remote mode of the bench harness: measure any OpenAI-compatible server over streaming.

The harness sends each prompt as one streaming request (``stream: true`` with
``stream_options: {"include_usage": true}``), reads the server-sent events itself, and times
every request on the client side. It also reads the server's own speculative-decoding
metrics before and after the run and reports the difference.

Public API
----------
``measure_endpoint(endpoint, prompts, *, model=None, max_new_tokens=128, concurrency=1,
api="chat", api_key=None, temperature=0.0, timeout_s=300, warmup=0, extra_body=None,
on_done=None) -> RemoteRun``
    ``endpoint``: the server root (``http://host:8000``); a trailing ``/v1``,
    ``/v1/chat/completions`` or ``/v1/completions`` is accepted and stripped.
    ``prompts``: :class:`specdecode.io.prompts.Prompt` objects (``id``, ``category``,
    ``messages`` or ``text``) or plain strings (ids ``"0"``, ``"1"``..., category
    ``"default"``). ``api="chat"`` posts ``messages`` to ``/v1/chat/completions`` (a
    text-only prompt becomes one user message); ``api="completions"`` posts ``prompt`` to
    ``/v1/completions`` (a chat prompt sends its message contents joined by blank lines, no
    template). ``model=None`` asks ``GET /v1/models`` and takes the first id.
    ``concurrency`` requests are in flight at once (a closed loop: a new request starts when
    one finishes), on threads sharing one ``httpx.Client``. ``warmup`` untimed requests
    (the first prompt, at most 16 tokens) go before the measured run. ``extra_body`` is
    merged into every request body (e.g. ``{"ignore_eos": True}`` for vLLM/SGLang).
    ``on_done(result)`` is called on the calling thread as each request finishes (e.g. to
    advance a progress bar; an exception it raises cancels the requests not yet started and
    propagates). A failed request (HTTP error, connection error, stream cut
    short, ``error`` event, empty output, ``timeout_s`` exceeded) never raises: it is
    recorded with ``ok=False`` and a message that says what happened: the HTTP status and the
    server's error text, or how the stream ended ([DONE] or a closed connection, no
    ``finish_reason``: "cut short") after how many chunks, how many with content. A response
    is complete only with a ``finish_reason`` and some content. Only a failed model look-up (``model=None``
    and no usable ``/v1/models``) raises :class:`RemoteError`, before anything is timed.

:class:`RemoteRun` (what ``measure_endpoint`` returns)
    ``endpoint`` (normalised root), ``api``, ``model``, ``max_new_tokens``, ``concurrency``,
    ``temperature``, ``started_at`` (Unix time), ``wall_s`` (first request sent to last one
    finished), ``results`` (one :class:`RequestResult` per prompt, in prompt order),
    ``server_spec`` (dict or ``None``), ``server_spec_reason`` (why it is ``None``), ``server``
    (the server software when ``/v1/models`` reveals it: :func:`identify_server`), and
    the methods ``summary()`` (= :func:`summarize_run`), ``records(method, run)``
    (= :func:`to_records`) and ``to_dict()`` (JSON-ready: summary, server metrics, every
    request).

:class:`RequestResult` (one request)
    ``prompt_id``, ``category``, ``ok``, ``error`` (message or ``None``), ``status`` (HTTP
    status, ``None`` when no response came), ``start_s``/``end_s`` (seconds since the run
    started), ``latency_s`` (end to end), ``ttft_s`` (to the first chunk with non-empty
    content; a role-only first chunk does not count), ``itl_s`` (gaps between successive
    content chunks), ``tpot_s`` = (latency - TTFT) / (completion tokens - 1),
    ``completion_tokens`` and ``tokens_source`` (``"usage"`` when the server reported usage,
    else ``"chunks"``: content chunks counted, which undercounts a server that packs several
    tokens, e.g. a whole accepted draft, into one chunk), ``prompt_tokens`` (from usage, or
    ``None``), ``cached_tokens`` (usage's ``prompt_tokens_details.cached_tokens``: the prompt tokens
    the server's prefix cache gave, or ``None`` when it does not say), ``chunks`` (data events
    received), ``content_chunks``, ``done`` ([DONE] seen), ``text``, ``reasoning`` (``reasoning_content``/``reasoning``
    deltas, counted as content for timing), ``finish_reason``, ``tok_per_s`` = completion
    tokens / latency, and ``itl_summary()`` (median/p90/p99 in seconds).

:func:`summarize_run(run) -> dict`
    ``requests``, ``ok``, ``failed``, ``errors`` (message -> count), ``wall_s``,
    ``completion_tokens`` (sum over successful requests), ``output_tok_per_s`` (that sum /
    ``wall_s``: the server's aggregate throughput), ``request_tok_per_s_median``,
    ``latency_ms_median``, ``ttft_ms_median``/``_p90``/``_p99``, ``tpot_ms_median``,
    ``itl_ms_median``/``_p90``/``_p99`` (over all gaps of all successful requests pooled),
    ``tokens_source`` (``usage``, ``chunks`` or ``mixed``), ``prompt_tokens`` and
    ``cached_prompt_tokens`` (sums; the latter ``None`` when the server reported none), ``server_spec``,
    ``server_spec_reason``, ``server``, ``model`` and ``hints`` (:func:`likely_causes`: for
    failures with a known cause, e.g. llama-cpp-python cutting streams at concurrency > 1 by
    default, what happened and the flag that changes it; and a note when tokens were counted
    from chunks). Latency statistics are ``None`` when no request succeeded.

:func:`to_records(run, method="remote", run_index=0) -> list[dict]`
    One dict per *successful* request shaped like :func:`specdecode.bench.harness.run_interleaved`'s
    records (``method``, ``run``, ``prompt_id``, ``category``, ``prompt_tokens``,
    ``num_tokens``, ``token_ids`` (always ``[]``: the server sends text), ``elapsed_s``,
    ``ttft_s``, ``tok_per_s``) plus ``tpot_s``, ``itl_median_s``, ``tokens_source`` and
    ``text``, so ``bench.summarize`` can consume them. Since ``token_ids`` is empty,
    ``summarize``'s ``outputs_match_baseline`` is meaningless between two remote methods
    (compare ``text`` instead).

Server speculative metrics (``server_spec``), read from the first source that has them:

* ours, Prometheus text at ``GET /metrics``: ``specdecode_spec_cycles_total``,
  ``specdecode_spec_draft_tokens_total``, ``specdecode_spec_accepted_tokens_total`` and
  ``specdecode_spec_accepted_per_position_total{position="1"}``... (1-based).
* vLLM, ``GET /metrics``: ``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``
  and ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``... (0-based);
  samples are summed over other labels (``model_name``, ``engine``).
* SGLang, ``GET /get_server_info`` (then ``/server_info``): ``avg_spec_accept_length`` at the
  top level or in ``internal_states[*]`` (averaged over data-parallel ranks). It is a gauge
  (a recent running average), so the value after the run is reported, not a difference.

For the counter sources the dict holds ``source`` (``"specdecode"`` or ``"vllm"``),
``cycles`` (verify steps / drafts), ``draft_tokens``, ``accepted_tokens`` (run deltas),
``accept_length`` = 1 + accepted / cycles, ``accept_rate`` = accepted / drafted and
``per_position`` (acceptance per cycle at draft position 1, 2, ...: index 0 is the first
draft token for both sources); the rates are ``None`` when no cycle ran (or, for
``accept_length``/``per_position``, when the server has no cycle counter). A ``note`` key
appears when there was no snapshot before the run (totals since server start). For SGLang:
``source="sglang"``, ``accept_length`` (after) and ``accept_length_before``. Counters are
server-wide: other clients' traffic during the run is counted too. ``server_spec`` is
``None`` when no source is available, and ``server_spec_reason`` says what was tried.
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
