"""The `specdecode` command line: the only place with argparse, rich output and exit codes.

Each command lives in its own module with ``add_parser(subparsers)`` (which sets
``func``); ``main`` applies a launch profile before any library starts, spawns
tensor-parallel workers when asked, and turns the library's errors into exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import random
import sys
from collections.abc import Iterable
from typing import NoReturn

from specdecode.cli.commands import SUBCOMMANDS

# Commands whose every rank can run the same loop on its shard (SPMD); rank 0 reports.
TP_COMMANDS = ("generate", "bench", "sweep", "check", "serve")


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" when run from a tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdecode")
    except PackageNotFoundError:
        return "unknown"


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the full subparsers of ``commands`` (None: all of them); every other command is
    listed by name and help alone, without importing its module (and torch): `specdecode --help` is fast."""
    parser = _Parser(prog="specdecode", description="Fast, measured LLM decoding with EAGLE-3 speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdecode {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    full = set(SUBCOMMANDS if commands is None else commands)
    for name, (module, about) in SUBCOMMANDS.items():
        if name in full:
            importlib.import_module(f"specdecode.cli.{module}").add_parser(sub)
        else:
            sub.add_parser(name, help=about, add_help=False)
    for command in sub.choices.values():
        _show_defaults(command)
    return parser


class _Parser(argparse.ArgumentParser):
    """Errors in one line, naming the command and where its flags are described (argparse printed the whole
    usage first: 14 lines for `sweep`). Subparsers are of this class too (argparse's default)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already names it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS or default in ([], "", ())
        if action.option_strings and "default" not in text.lower() and not unset:
            shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
            text += f" (default: {shown.replace('%', '%%')})"
        return text


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:  # argparse has no public walk
        if isinstance(action, argparse._SubParsersAction):  # `data build`, `data export`
            for child in action.choices.values():
                _show_defaults(child)


def main(argv: list[str] | None = None) -> int:
    from specdecode.bench.profiles import reexec_with_profile

    argv = sys.argv[1:] if argv is None else argv
    try:
        # before torch is imported: thread pools and NCCL read their variables at start-up
        reexec_with_profile(argv)
    except ValueError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    from specdecode.io.errors import ModelLoadError

    parser = build_parser(argv[:1])  # the command named first, if any; the rest only listed
    args = parser.parse_args(argv)
    try:
        tp = getattr(args, "tensor_parallel", 1)  # `launch --tp` is the engine's, not ours
        if tp > 1 or (int(os.environ.get("WORLD_SIZE", "1")) > 1 and hasattr(args, "tensor_parallel")):
            from specdecode.runtime.distributed import WORKER_ENV, init_from_env, spawn

            if args.command not in TP_COMMANDS:
                raise ValueError(f"`specdecode {args.command}` does not run tensor parallel (--tp works with "
                                 f"{', '.join(TP_COMMANDS)})")

            if tp > 1 and not os.environ.get(WORKER_ENV) and "WORLD_SIZE" not in os.environ:
                if getattr(args, "temperature", 0) > 0 and getattr(args, "seed", 0) is None:
                    argv = [*argv, "--seed", str(random.randrange(2**31))]  # every rank samples alike
                return spawn(main, argv, tp)
            init_from_env(getattr(args, "device", "cpu"))
        code: int = args.func(args)
        return code
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        print(f"specdecode {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (NotADirectoryError, FileExistsError, IsADirectoryError, PermissionError) as e:
        # a path that cannot be made or written (SPECDECODE_CACHE or --store under a file, a read-only --out)
        what = {FileExistsError: f"{e.filename} is a file where a directory is needed",
                NotADirectoryError: f"a part of {e.filename} is a file, not a directory"}.get(
                    type(e), f"{e.strerror}: {e.filename}")
        print(f"specdecode {args.command}: error: {what}; give a path that can be created and written (check "
              f"SPECDECODE_CACHE and the command's path flags)", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`specdecode generate --stream | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + 13  # as a tool killed by SIGPIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # after BrokenPipeError, one of them
        if e.errno not in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"specdecode {args.command}: error: {e.strerror}: {e.filename}; give a path on a writable file system "
              f"with room (check SPECDECODE_CACHE and the command's path flags)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
