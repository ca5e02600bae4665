"""`--help` keeps its promises: every flag of every command says what it does and its default, and the
command list prints without importing torch (each command's module does)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = ""):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}".strip())


def test_every_flag_has_help_and_shows_its_default():
    missing, unshown = [], []
    for path, parser in _parsers(build_parser()):
        if not path:
            continue
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help:
                missing.append(f"{path} {action.option_strings or action.dest}")
            elif action.option_strings and isinstance(action.default, int | float | str) \
                    and not isinstance(action.default, bool) and action.default != "":
                flag = action.option_strings[-1]
                shown = f"(default: {action.default})" in text or "default" in action.help.lower()
                if not shown:
                    unshown.append(f"{path} {flag}")
    assert not missing, missing
    assert not unshown, unshown


def test_the_train_defaults_are_the_readme_recipe():
    args = build_parser(["train"]).parse_args(["train", "--data", "d", "--out", "o"])
    assert (args.draft_vocab_size, args.ttt_steps, args.lr, args.epochs, args.batch_tokens) == (8192, 3, 1e-3, 8, 2048)


def test_the_command_list_needs_no_torch():
    code = ("import sys\nfrom specdecode.cli.main import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("no torch"), out.stdout + out.stderr
    assert all(name in out.stdout for name in SUBCOMMANDS) and "answer one prompt" in out.stdout
