"""`specdecode train`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.training.trainer import add_train_args, cmd_train

    p = sub.add_parser('train', help='train an EAGLE-3 drafter (training-time test, online target)',
                       description='Train an EAGLE-3 draft head on a data set from `specdecode data build`. Resumes from OUT/checkpoint; writes OUT/config.json + model.safetensors in the SGLang/vLLM/SpecForge format.')
    add_train_args(p)
    p.set_defaults(func=cmd_train)
