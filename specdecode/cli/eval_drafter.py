"""`specdecode eval-drafter`: held-out acceptance, trainer estimate vs engine measurement
(a front end to ``specdecode.training.evaluate.eval_drafter``); prints one JSON object."""

from __future__ import annotations

import argparse
import json

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_model_args, compile_notice, notice, runtime_config
from specdecode.core.quant import DRAFTER_WEIGHT_FORMATS
from specdecode.io.checkpoints import check_drafter_dir
from specdecode.training.dataset import DataSet
from specdecode.training.evaluate import EvalDrafterConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-drafter", help=SUBCOMMANDS["eval-drafter"][1],
                       description="On held-out greedy samples, compare the accept length simulated from the "
                                   "training-time test with the one the engine measures (same prompts).")
    d = EvalDrafterConfig(data="", drafter="")
    p.add_argument("--data", required=True, nargs="+",
                   help="data set whose greedy held-out answers are measured; with --acceptance-table one or more, "
                        "each an equal share (e.g. the training data and datasets/smollm2-135m-unseen-v1)")
    p.add_argument("--drafter", required=True, help="the trained drafter directory to evaluate")
    p.add_argument("--depth", type=int, default=d.depth, help="chain depth (num_steps)")
    p.add_argument("--samples", type=int, default=d.samples, help="held-out answers (per data set)")
    p.add_argument("--acceptance-table", action="store_true",
                   help="instead: measure per-position acceptance of the deepest candidate shape of each top-k "
                        "with the engine and write acceptance.json into the drafter directory (or --out), what "
                        "--spec-config auto reads")
    p.add_argument("--out", default=None, help="with --acceptance-table: directory for acceptance.json")
    p.add_argument("--drafter-weights", choices=("auto", *DRAFTER_WEIGHT_FORMATS), default="auto",
                   help="the format of the drafter the engine measures (generate's --drafter-weights; the trainer's "
                        "estimate reads the float weights)")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.runtime.session import start
    from specdecode.training.evaluate import eval_drafter

    if len(args.data) > 1 and not args.acceptance_table:
        notice("error: more than one --data is for --acceptance-table; the trainer-vs-engine comparison reads one")
        return 2
    check_drafter_dir(args.drafter)  # the inputs before the model loads
    for path in args.data:
        if not DataSet(path).exists():
            DataSet(path).index()  # raises its error: not found, and which command builds one
    session = start(runtime_config(args), on_compile=compile_notice, log=notice)
    if args.acceptance_table:
        import sys

        from specdecode.training.evaluate import AcceptanceTableConfig, acceptance_table

        table = AcceptanceTableConfig(data=tuple(args.data), drafter=args.drafter, samples=args.samples, out=args.out,
                                      drafter_weights=args.drafter_weights)
        print(json.dumps(acceptance_table(table, session, on_shape=lambda s: print(f"measuring {s}",
                                                                                    file=sys.stderr))))
        return 0
    cfg = EvalDrafterConfig(data=args.data[0], drafter=args.drafter, depth=args.depth, samples=args.samples,
                            drafter_weights=args.drafter_weights)
    print(json.dumps(eval_drafter(cfg, session)))
    return 0
