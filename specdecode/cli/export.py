"""`specdecode export`."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.integrations.launch import add_export_args, cmd_export

    p = sub.add_parser('export', help='write a drafter for SGLang or vLLM (their aux-layer-id conventions differ)',
                       description='write a drafter for SGLang or vLLM (their aux-layer-id conventions differ)')
    add_export_args(p)
    add_model_args(p)
    p.set_defaults(func=cmd_export)
