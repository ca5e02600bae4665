"""`--help` keeps its promises: every flag of every command says what it does and its default, and the
command list prints without importing torch (each command's module does)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

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
            hidden = action.help == argparse.SUPPRESS  # an old spelling
            if hidden or isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
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


def test_renamed_flags_are_refused_with_their_new_name(capsys):
    """One name per concept: sweep --num-steps/--num-draft-tokens as generate's, compile --compile-max-len as
    serve's, train --dtype as every other command's; an old name is refused (exit 2) with the new one, hidden
    from --help, and the new name parses."""
    new = {"--steps": "--num-steps", "--draft-tokens": "--num-draft-tokens", "--max-len": "--compile-max-len",
           "--target-dtype": "--dtype"}
    cases = {("sweep", "--steps", "1,2"): ("steps", [1, 2]),
             ("sweep", "--draft-tokens", "4"): ("draft_tokens", [4]),
             ("compile", "--max-len", "256"): ("max_len", 256),
             ("train", "--data", "d", "--out", "o", "--target-dtype", "float32"): ("target_dtype", "float32")}
    for argv, (dest, value) in cases.items():
        old = argv[-2]
        parser = build_parser(argv[:1])
        with pytest.raises(SystemExit) as refused:
            parser.parse_args(list(argv))
        assert refused.value.code == 2 and f"{old} is now {new[old]}" in capsys.readouterr().err
        assert getattr(parser.parse_args([new.get(a, a) for a in argv]), dest) == value
        command = next(p for path, p in _parsers(parser) if path == argv[0])
        assert not re.search(rf"(?<![\w-]){re.escape(old)}\b", command.format_help()), old
