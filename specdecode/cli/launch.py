"""`specdecode launch`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.integrations.launch import add_launch_args, cmd_launch

    p = sub.add_parser('launch', help='launch SGLang or vLLM with EAGLE-3 flags, a launch profile and a recorded fingerprint',
                       description="Build the engine's server command (speculative flags, tensor parallel size), apply the launch profile's environment, record the launch in the results store, and run it (--dry-run prints it). Measure it with `specdecode bench --endpoint`.")
    add_launch_args(p)
    p.set_defaults(func=cmd_launch)
