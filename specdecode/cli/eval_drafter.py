"""`specdecode eval-drafter`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.trainer import add_eval_args, cmd_eval

    p = sub.add_parser('eval-drafter', help='held-out acceptance: trainer estimate vs engine measurement',
                       description='On held-out greedy samples, compare the accept length simulated from the training-time test with the one the engine measures (same prompts).')
    add_eval_args(p)
    p.set_defaults(func=cmd_eval)
