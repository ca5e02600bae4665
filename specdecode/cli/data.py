"""`specdecode data build`: the target answers seed prompts (and instructions it bootstraps);
a front end to ``specdecode.training.data.build`` with a status line and a progress bar."""

from __future__ import annotations

import argparse
import json
import math
import signal
from typing import Any

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_model_args, compile_notice, existing_file, notice, runtime_config
from specdecode.training.data import LIKE_SETTINGS, BuildProgress, DataBuildConfig, settings_like


def add_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help=SUBCOMMANDS["data"][1],
                          description="Build drafter training data with the target model, or export it.")
    commands = data.add_subparsers(dest="data_command", required=True)
    add_export_parser(commands)
    p = commands.add_parser(
        "build", help="let the target answer prompts; store tokens and loss masks",
        description="Apply the chat template to seed prompts (and instructions the target bootstraps from them), "
                    "let the target generate the responses (batched; greedy and sampled mix), and append them to a "
                    "resumable on-disk data set with a held-out split.")
    d = DataBuildConfig(out="", prompts=())
    p.add_argument("--out", required=True, help="data directory (created, or resumed if it exists)")
    p.add_argument("--prompts", nargs="+", type=existing_file, default=None,
                   help="prompt files: self-instruct seed tasks, user-oriented instructions, or jsonl with "
                        "'prompt' / 'instruction' / 'messages' (Spec-Bench is refused); required unless --like")
    p.add_argument("--like", default=None, metavar="DATA",
                   help="the draw and generation settings of this data set (its manifest's prompt files in their "
                        "order, --sample, --category-weights, answer and prompt lengths, sampling, held-out percent, "
                        "seed; a merged set: its first part's; not its own --skip-from); flags given as well win. With "
                        "a larger --sample and --skip-from DATA it answers more of the same draw, e.g. on another "
                        "machine")
    p.add_argument("--prompts-dir", default=None, metavar="DIR",
                   help="with --like: look up DATA's prompt files by name in DIR (long/ ones in DIR/long), where "
                        "the corpus lies elsewhere than its manifest says")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="draw N prompts from the files, an equal share per category (the files' 'category' field; "
                        "a category with fewer prompts gives its rest to the others); default: every prompt")
    p.add_argument("--category-weights", type=parse_weights, default=None, metavar="CAT=W,...",
                   help="with --sample: each category's share relative to 1.0 (unnamed categories), e.g. "
                        "general=2,coding=2,classification=0.5; 0 leaves a category out")
    p.add_argument("--bootstrap", type=int, default=d.bootstrap, help="new instructions to bootstrap with the target")
    p.add_argument("--limit", type=int, default=d.limit, help="stop at this many samples in total")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default: {d.max_new_tokens}")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help=f"default: {d.max_prompt_tokens}")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"answers generated together (continuous batching: a finished answer's slot takes the "
                        f"next prompt; saved every this many answers; default: {d.batch_size})")
    p.add_argument("--sampled-fraction", type=float, default=None,
                   help=f"share of responses sampled (the rest greedy); default: {d.sampled_fraction}")
    p.add_argument("--temperature", type=float, default=None, help=f"default: {d.temperature}")
    p.add_argument("--top-p", type=float, default=None, help=f"default: {d.top_p}")
    p.add_argument("--heldout-percent", type=float, default=None, help=f"default: {d.heldout_percent}")
    p.add_argument("--seed", type=int, default=None, help=f"default: {d.seed}")
    p.add_argument("--skip-from", nargs="+", default=list(d.skip_from), metavar="DATA",
                   help="data sets whose prompts are not answered again: a new data set over a larger draw holds "
                        "only new prompts (then `specdecode data merge` the two)")
    add_model_args(p)
    p.set_defaults(func=run)
    add_merge_parser(commands)


def add_merge_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "merge", help="join data sets of one model into a new one",
        description="Write the samples of two or more data sets (one model, chat template and held-out rule) into "
                    "a new data set, in the order given; a prompt answered in an earlier one is left out of the "
                    "later ones. Each part's manifest is kept in the new manifest (how its answers were made), so "
                    "answers built on another machine (a GPU's next to a CPU's) join the CPU-built set for "
                    "`specdecode train` without losing which is which.")
    p.add_argument("data", nargs="+", help="data directories (from `specdecode data build`), the first first")
    p.add_argument("--out", required=True, help="the new data directory (must not exist, or be empty)")
    p.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from specdecode.training.dataset import merge

    try:
        counts = merge(args.data, args.out)
    except (FileNotFoundError, ValueError) as e:
        notice(f"error: {e}")
        return 2
    print(json.dumps({"out": args.out, **counts}))
    return 0


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    from specdecode.training.export import CUT_ANSWERS, EXPORT_FORMATS

    p = commands.add_parser(
        "export", help="write a data set for another trainer (SpecForge's conversations JSONL)",
        description="Write a data set's samples as SpecForge's training data: one JSON line per sample, "
                    "{id, conversations: [system, user, assistant]}, the system message always written (the "
                    "prompt the target answered; SpecForge keeps a conversation's own system message). Each "
                    "conversation re-renders to the stored prompt tokens, else it is left out and counted. Train "
                    "with SpecForge's --chat-template qwen for SmolLM2 (the same ChatML headers).")
    p.add_argument("data", help="data directory (from `specdecode data build`)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="specforge", help="default: specforge")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--split", choices=("train", "heldout", "all"), default="train", help="default: train")
    p.add_argument("--model", default=None,
                   help="the model whose tokenizer built the data (default: the manifest's, else SmolLM2's GGUF)")
    p.add_argument("--cut-answers", choices=CUT_ANSWERS, default="keep",
                   help="answers that stopped at the token limit (no end of turn; SpecForge trains one after "
                        "every answer): keep them (default; counted), drop them, or mark them with "
                        "\"answer_cut\": true")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdecode.io.errors import ModelLoadError
    from specdecode.training.dataset import DataSet
    from specdecode.training.export import dataset_tokenizer, export_specforge

    ds = DataSet(args.data)
    try:
        tokenizer = dataset_tokenizer(ds, args.model)
    except (FileNotFoundError, ValueError, ModelLoadError) as e:
        notice(f"error: {e}")
        return 2
    summary = export_specforge(ds, tokenizer, Path(args.out), None if args.split == "all" else args.split,
                               on_progress=lambda done, total: notice(f"exported {done}/{total} samples"),
                               cut_answers=args.cut_answers)
    if summary.cut_answers and args.cut_answers == "keep":
        notice(f"note: {summary.cut_answers} answer(s) stopped at the token limit; SpecForge will train an end of "
               "turn after each: --cut-answers drop leaves them out, --cut-answers mark flags them")
    print(json.dumps({"out": args.out, "split": args.split, "cut_answers": args.cut_answers, **summary.as_dict()}))
    return 0


def parse_weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            weight = float(value)
            if not math.isfinite(weight) or weight < 0:
                raise ValueError
            out.append((name.strip(), weight))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected CATEGORY=WEIGHT with a finite WEIGHT >= 0, e.g. coding=2") from None
    return tuple(out)


def build_config(args: argparse.Namespace) -> DataBuildConfig:
    """The flags given, then --like's settings, then DataBuildConfig's defaults."""
    if args.prompts_dir and not args.like:
        raise ValueError("--prompts-dir looks up the prompt files of --like DATA: give --like, or list --prompts")
    like = settings_like(args.like, args.prompts_dir) if args.like else {}
    given = {k: getattr(args, k) for k in (*LIKE_SETTINGS, "prompts") if getattr(args, k) is not None}
    fields = like | given
    if "prompts" not in fields:
        raise ValueError("data build needs prompt files: --prompts FILE... (or --like DATA, a data set whose "
                         "prompt files and settings to use)")
    fields["prompts"] = tuple(fields["prompts"])
    return DataBuildConfig(out=args.out, bootstrap=args.bootstrap, limit=args.limit, batch_size=args.batch_size,
                           skip_from=tuple(args.skip_from), **fields)


class BuildDisplay:
    """``build``'s progress on stderr: the seed count, a status line while bootstrapping, a bar while generating;
    where stderr is not a terminal (a build of hours in the background, its log a file), instead of a bar, which
    draws nothing there, a line as answers are saved, at most one every ``every`` seconds, and the last count when
    the build ends or is stopped."""

    def __init__(self, console: Any = None, every: float = 60.0) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True, soft_wrap=True)
        self.lines = not self.console.is_terminal
        self.every = every
        self.last_line = -math.inf
        self.unsaid: BuildProgress | None = None  # the newest count not printed yet (lines mode)
        self.status: Any = None
        self.progress: Any = None
        self.task: Any = None

    def __call__(self, ev: BuildProgress) -> None:
        if ev.stage == "seeds":
            self.console.print(f"{ev.done} unique seed prompts from {ev.total} file(s)")
        elif ev.stage == "bootstrap":
            if self.status is None:
                self.status = self.console.status("bootstrapping instructions")
                self.status.start()
            if ev.asked:
                self.status.update(f"bootstrapping instructions: {ev.done}/{ev.total} kept of {ev.asked} asked")
        elif ev.stage == "bootstrapped":
            self._stop_status()
            self.console.print(f"bootstrapped {ev.done} new instructions in {ev.seconds:.0f} s")
        elif ev.stage == "generate":
            if self.lines:
                self.unsaid = ev
                if ev.seconds - self.last_line >= self.every or ev.done == ev.total:
                    self._say(ev)
                return
            if self.progress is None:
                self._start_bar(ev.total)
            self.progress.update(self.task, completed=ev.done, rate=self._rate(ev))

    @staticmethod
    def _rate(ev: BuildProgress) -> str:
        return f"{ev.new_tokens / ev.seconds:.0f} new tok/s" if ev.seconds else ""

    def _say(self, ev: BuildProgress) -> None:
        self.last_line, self.unsaid = ev.seconds, None
        rate = self._rate(ev)
        self.console.print(f"generated {ev.done}/{ev.total} answers in {ev.seconds:.0f} s"
                           + (f", {rate}" if rate else ""))

    def _start_bar(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                   TimeRemainingColumn())
        self.progress = Progress(*columns, console=self.console)
        self.progress.start()
        self.task = self.progress.add_task("gen", total=total, rate="")

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def close(self) -> None:
        self._stop_status()
        if self.unsaid is not None:  # stopped (Ctrl-C, SIGTERM) between two lines: its last count
            self._say(self.unsaid)
        if self.progress is not None:
            self.progress.stop()


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the saving of the first
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from specdecode.runtime.session import start
    from specdecode.training.data import build
    from specdecode.training.dataset import DataSet

    cfg = build_config(args)
    for other in cfg.skip_from:  # before the model loads
        if not DataSet(other).exists():
            notice(f"error: --skip-from {other}: no data set there (its index.jsonl is missing)")
            return 2
    session = start(runtime_config(args), on_compile=compile_notice, log=notice)
    # a build stopped by SIGTERM (`timeout`, a job scheduler, kill) saves the answers it has finished, as Ctrl-C does
    signal.signal(signal.SIGTERM, _interrupt)
    display = BuildDisplay()
    try:
        summary = build(cfg, session, on_progress=display)
    finally:
        display.close()
    print(json.dumps(summary))
    return 0
