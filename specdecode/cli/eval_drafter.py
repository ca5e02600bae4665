"""`specdecode eval-drafter`: held-out acceptance, trainer estimate vs engine measurement
(a front end to ``specdecode.training.evaluate.eval_drafter``); prints one JSON object."""

from __future__ import annotations

import argparse
import json

from specdecode.training.evaluate import EvalDrafterConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-drafter", help="held-out acceptance: trainer estimate vs engine measurement",
                       description="On held-out greedy samples, compare the accept length simulated from the "
                                   "training-time test with the one the engine measures (same prompts).")
    d = EvalDrafterConfig(data="", drafter="")
    p.add_argument("--data", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--depth", type=int, default=d.depth, help="chain depth (num_steps)")
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.runtime.session import RuntimeConfig, start
    from specdecode.training.evaluate import eval_drafter

    session = start(RuntimeConfig(model=args.model, dtype=args.dtype, device="cpu", threads=args.threads))
    cfg = EvalDrafterConfig(data=args.data, drafter=args.drafter, depth=args.depth, samples=args.samples)
    print(json.dumps(eval_drafter(cfg, session)))
    return 0
