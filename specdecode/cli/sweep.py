"""`specdecode sweep`."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.bench.sweep import add_sweep_args, cmd_sweep

    p = sub.add_parser('sweep', help='grid over num_steps/topk/num_draft_tokens; finds the best configuration',
                       description='Measure every configuration on the same prompts, interleaved with the baseline; report the optimum, verify cost vs tokens verified, acceptance per position, a cost-model prediction, and PNG plots.')
    add_sweep_args(p)
    add_model_args(p)
    p.set_defaults(func=cmd_sweep)
