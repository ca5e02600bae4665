"""`specdecode serve`."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args, add_spec_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.serving.server import add_serve_args, cmd_serve

    p = sub.add_parser('serve', help='OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)',
                       description="Serve the model over HTTP with OpenAI's /v1/completions and /v1/chat/completions (streaming or not), speculative decoding when a drafter is configured, and Prometheus counters on /metrics.")
    add_serve_args(p)
    add_model_args(p)
    add_spec_args(p)
    p.set_defaults(func=cmd_serve)
