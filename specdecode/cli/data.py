"""`specdecode data build`."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.data import add_data_args, cmd_data_build

    data = sub.add_parser("data", help="build drafter training data with the target model")
    p = data.add_subparsers(dest="data_command", required=True).add_parser(
        "build", help="let the target answer prompts; store tokens and loss masks",
        description="Apply the chat template to seed prompts (and instructions the target bootstraps from them), "
                    "let the target generate the responses (batched; greedy and sampled mix), and append them to a "
                    "resumable on-disk data set with a held-out split.")
    add_data_args(p)
    add_model_args(p)
    p.set_defaults(func=cmd_data_build)
