"""`specdecode serve`: flags -> ``ServeConfig``, a started session and its decoder, then
``specdecode.serving.serve.serve``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from dataclasses import replace

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_model_args, add_spec_args, compile_notice, decoder_spec, notice, runtime_config
from specdecode.core.batching import BatchConfig
from specdecode.core.prefixcache import BLOCK
from specdecode.core.specpolicy import SPEC_POLICIES
from specdecode.serving.config import ServeConfig

_DEFAULTS = ServeConfig()
MIN_CONTEXT = 128  # tokens per request a server holds at least (--context-length)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help=SUBCOMMANDS["serve"][1],
                       description="Serve the model over HTTP with OpenAI's /v1/completions and "
                                   "/v1/chat/completions (streaming or not), speculative decoding when a drafter "
                                   "is configured, and Prometheus counters on /metrics.")
    add_serve_args(p)
    add_model_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host,
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it, "
                        "so set an API key)")
    g.add_argument("--port", type=int, default=d.port, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$SPECDECODE_API_KEY, which keeps the key out of the process list; none)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: derived from the model, e.g. smollm2-135m-instruct)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413 (default: {d.max_body_bytes})")
    g.add_argument("--max-queued", type=int, default=d.max_queued,
                   help=f"requests waiting beyond this get 503 (default: {d.max_queued})")
    add_batch_args(g)
    g.add_argument("--prefix-cache-tokens", type=int, default=None,
                   help=f"prompt tokens whose KV is kept for later prompts that start the same way (a system prompt, "
                        f"a repeated question): their prefill is skipped. Blocks of {BLOCK} tokens are kept, least "
                        "recently used evicted first, and reused in whole prefill chunks (--chunked-prefill-size), "
                        "so a prompt gets the keys and values its own prefill computes and a repeat the same answer; "
                        "OpenAI's usage.prompt_tokens_details.cached_tokens reports it "
                        "per request. Default: half the KV pool's tokens; 0: off")
    g.add_argument("--compile-max-len", type=int, default=d.compile_max_len,
                   help="compiled steps: the graphs for contexts up to this many tokens are loaded (or, with --compile "
                        "on, built) before serving, for every batch size up to --max-running-requests; longer "
                        f"contexts and prompt prefill run eager (default: {d.compile_max_len})")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds a shutdown (SIGTERM) waits for running requests, with /health answering 503 meanwhile "
                        "(default: 30)")
    g.add_argument("--log-interval", type=float, default=d.log_interval,
                   help="seconds between decode summaries in the log while busy (default: 10)")


def add_batch_args(g: argparse._ActionsContainer) -> None:
    """The continuous-batching flags: serve's, and `specdecode compile --serve`'s (the graphs follow them)."""
    b = _DEFAULTS.batch
    g.add_argument("--max-running-requests", type=int, default=b.slots,
                   help=f"requests decoded together in one batch; more wait in the queue (default: {b.slots})")
    g.add_argument("--context-length", type=int, default=None,
                   help="tokens per request (prompt + new tokens + speculative slots); the KV cache holds "
                        "this many per running request (default: the model's context)")
    g.add_argument("--chunked-prefill-size", type=int, default=b.prefill_chunk,
                   help=f"prompt tokens prefilled per step, so a long prompt does not stall the running "
                        f"requests (default: {b.prefill_chunk})")
    g.add_argument("--spec-policy", choices=SPEC_POLICIES, default=b.spec_policy,
                   help="when to speculate: always, never, auto (both modes timed per batch size bucket before "
                        "serving, the faster kept: the choice is a function of the batch size, so a repeated greedy "
                        "or seeded request gives the same answer), or adaptive (re-decided from step times while "
                        f"serving: follows the load, but in bf16 a repeated request may change; default: "
                        f"{b.spec_policy})")
    g.add_argument("--batch-invariant", action="store_true",
                   help="every step runs all --max-running-requests rows, so a request's tokens do not depend on "
                        "what else is batched, in bf16 too (without it, bf16 answers can change with the batch's "
                        "company: docs/reproducibility.md); one way at every batch size: "
                        "--spec-policy never (the default here: faster in this mode) or always. Cost: a request "
                        "alone pays for the full batch (bf16 + q4, 4 slots: 0.76x alone, 0.95x at 4)")


def batch_config(args: argparse.Namespace) -> BatchConfig:
    """The batching flags as a ``BatchConfig`` (ValueError on a bad value)."""
    for flag, value, least in (("--max-running-requests", args.max_running_requests, 1),
                               ("--chunked-prefill-size", args.chunked_prefill_size, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.context_length is not None and args.context_length < MIN_CONTEXT:
        # refused before the model loads: the engine's own check (spec policy auto's start-up timing, about 70
        # tokens for SmolLM2) needs the tokenizer and the drafter's shape, so it came after a 17 s load
        raise ValueError(f"--context-length must be >= {MIN_CONTEXT} tokens, got {args.context_length}: a request "
                         "holds its chat template, prompt, answer and speculative slots")
    policy = args.spec_policy
    if args.batch_invariant and policy == "auto":  # auto may choose per batch size: one mode for every size
        # plain: in the batch-invariant engine speculative steps were slower than plain ones, alone and batched
        # (benchmarks/results/reproducibility/)
        policy = "never"
    return BatchConfig(slots=args.max_running_requests, slot_tokens=args.context_length,
                       prefill_chunk=args.chunked_prefill_size, spec_policy=policy,
                       batch_invariant=args.batch_invariant)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The flags as a ``ServeConfig``; refused (ValueError, exit code 2) before any model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value, least in (("--max-body-bytes", args.max_body_bytes, 1), ("--max-queued", args.max_queued, 0),
                               ("--compile-max-len", args.compile_max_len, 2)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.prefix_cache_tokens is not None and not (args.prefix_cache_tokens == 0
                                                     or args.prefix_cache_tokens >= BLOCK):
        raise ValueError(f"--prefix-cache-tokens must be 0 (off) or at least one block of {BLOCK} tokens, "
                         f"got {args.prefix_cache_tokens}")
    batch = replace(batch_config(args), prefix_cache=args.prefix_cache_tokens)
    return ServeConfig(host=args.host, port=args.port,
                       api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY") or None,
                       served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                       max_queued=args.max_queued, shutdown_timeout=args.shutdown_timeout,
                       log_interval=args.log_interval, batch=batch, compile_max_len=args.compile_max_len)


def run(args: argparse.Namespace) -> int:
    from specdecode.runtime.decoders import build_decoder
    from specdecode.runtime.session import on_passing_thread, start

    config = serve_config(args)
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise ValueError("the server needs FastAPI and uvicorn: pip install 'specdecode[serve]'")
    from specdecode.serving.serve import check_port, serve

    if int(os.environ.get("RANK", "0")) == 0:  # under tensor parallelism only rank 0 listens
        check_port(config.host, config.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = decoder_spec(args)  # bad flags are refused before the model loads
    runtime = runtime_config(args)

    def load():
        session = start(runtime, on_compile=compile_notice, log=notice)
        return session, build_decoder(spec, session)

    # On CPU the model loads on a thread that then ends, so that the worker thread that generates
    # owns torch's only OpenMP team (on_passing_thread says why).
    # On CUDA it loads here: the current device is per thread.
    session, decoder = on_passing_thread(load, runtime.device)
    serve(session, decoder, config, spec)
    return 0
