"""`specdecode train`: a front end to ``specdecode.training.trainer.train`` with a progress bar;
prints the run's summary as JSON."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_renamed
from specdecode.training.features import FeatureProgress
from specdecode.training.trainer import SELECT_MODES, EvalDone, StepDone, TrainConfig, TrainEvent, TrainStarted

LOG_EVERY = 50  # steps per progress line where stderr is not a terminal

INT_FIELDS = ("draft_vocab_size", "ttt_steps", "max_len", "batch_tokens", "max_steps", "seed", "limit_samples",
              "skip_samples", "eval_every", "save_every", "eval_samples", "patience", "align_topk")
FLOAT_FIELDS = ("epochs", "lr", "warmup_ratio", "weight_decay", "grad_clip", "step_weight", "min_lr_ratio",
                "fc_lr_scale", "feature_noise", "min_delta", "tv_weight")

FIELD_HELP = {
    "patience": "stop once this many held-out evaluations in a row have not raised the best accept length by "
                "--min-delta (0, the default: run every epoch; --epochs is then the most the schedule allows)",
    "min_delta": "the gain in held-out accept length that counts for --patience (default: 0.01)",
    "align_topk": "GRIFFIN's token-alignable loss: a draft step after the first trains only where every earlier "
                  "step had the target's token in its top ALIGN_TOPK (2: the default tree's width; 0, the "
                  "default: every position, as EAGLE-3)",
    "skip_samples": "leave out the first N training samples (before --limit-samples), e.g. those the --init-from "
                    "drafter was trained on, when its data set has grown since",
    "epochs": "passes over the training samples; the learning-rate schedule spans them",
    "draft_vocab_size": "the draft head's vocabulary: the most frequent answer tokens of the training split",
    "ttt_steps": "training-time test: draft steps unrolled on the draft's own hidden states (the held-out "
                 "evaluation simulates a chain this long)",
    "max_len": "tokens of a sample trained on (prompt and answer; longer ones are cut)",
    "batch_tokens": "tokens per training batch (samples packed up to it)",
    "max_steps": "stop after N steps (default: --epochs' worth)",
    "seed": "seed of the initialisation, the batch order and the feature noise",
    "limit_samples": "train on the first N training samples only",
    "eval_every": "steps between held-out evaluations (and at the last step)",
    "save_every": "steps between checkpoints (OUT/checkpoint: a killed run resumes there)",
    "eval_samples": "greedy held-out samples per evaluation",
    "lr": "peak learning rate (AdamW)",
    "warmup_ratio": "share of the steps the learning rate warms up over, then cosine decay",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient-norm clip",
    "step_weight": "loss weight of draft step j is STEP_WEIGHT ** j",
    "min_lr_ratio": "the cosine decay ends at this share of --lr",
    "fc_lr_scale": "learning-rate factor of fc (it multiplies the target's large activations)",
    "tv_weight": "DSpark's acceptance loss: each draft step's loss is (1 - W) x cross-entropy + W x the total "
                 "variation between the target's and the draft's distributions (DSpark: 0.9; 0, the default: "
                 "cross-entropy alone, as EAGLE-3)",
    "feature_noise": "gaussian noise on each target tap, its std relative to the tap's RMS (0: none)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=SUBCOMMANDS["train"][1],
                       description="Train an EAGLE-3 draft head on a data set from `specdecode data build`. Resumes "
                                   "from OUT/checkpoint; writes OUT/config.json + model.safetensors in the "
                                   "SGLang/vLLM/SpecForge format.")
    d = TrainConfig(data="", out="")
    p.add_argument("--data", required=True, help="data directory from `specdecode data build`")
    p.add_argument("--out", required=True, help="output drafter directory (checkpoint inside; resumes if present); "
                                                "one that holds anything else is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="empty --out first (its checkpoint included: the run starts over) instead of refusing it")
    p.add_argument("--model", default=None, help="target model (default: the SmolLM2 GGUF)")
    for name in INT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=FIELD_HELP.get(name))
    for name in FLOAT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name), help=FIELD_HELP.get(name))
    p.add_argument("--select", default=d.select, choices=SELECT_MODES,
                   help="the weights written to OUT: the held-out evaluation with the highest simulated accept "
                        "length (best, kept in OUT/best as the run goes; it needs held-out samples) or the last step "
                        "(default: best)")
    p.add_argument("--dtype", default=d.target_dtype, dest="target_dtype",
                   help="dtype of the frozen target: auto (bfloat16 where the device computes bf16 natively, else "
                        "float32: bf16 on a CPU without it was 6x slower), bfloat16 or float32. Default: auto")
    add_renamed(p, "--target-dtype", "--dtype")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="the draft's matmuls in bf16 (fp32 master weights); default: where the device computes bf16 "
                        "natively (emulated, it was 25x slower than fp32)")
    p.add_argument("--random-init", action="store_true", help="do not warm-start from the target's last layer")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this trained EAGLE-3 drafter (its weights and draft vocabulary; "
                        "--draft-vocab-size must match it) instead of the target's last layer; the optimizer and "
                        "learning-rate schedule start afresh")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="compute the target's features once into DIR (about 4.6 KB per token in bf16) and read them "
                        "every epoch instead of running the target again (resumable; refused if made for other data)")
    p.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N | auto (default: cpu); the target and the "
                                                      "drafter both run there")
    p.add_argument("--eval-data", nargs="+", default=list(d.eval_data), metavar="DATA",
                   help="also evaluate on these data sets' held-out answers at every evaluation, reported beside "
                        "--data's (the best checkpoint is still chosen on --data's), e.g. "
                        "datasets/smollm2-135m-unseen-v1: prompts from outside the training corpus")
    p.add_argument("--variant", default="", metavar="FLAGS",
                   help="a variant of the head, comma-separated flags by their checkpoint names: fc_norm (an RMSNorm "
                        "on each tap before fc) and norm_output (later steps read the normed output) are EAGLE-3.1; "
                        "norm_before_fc, norm_before_residual. The drafter is then written in vLLM's speculators "
                        "layout. With --init-from, the new norms start at each tap's typical scale")
    p.set_defaults(func=run)


def train_config(args: argparse.Namespace) -> TrainConfig:
    fields = {k: getattr(args, k) for k in TrainConfig.__dataclass_fields__ if hasattr(args, k)}
    variant = tuple(v.strip() for v in args.variant.split(",") if v.strip())
    return TrainConfig(**fields | {"init_from_target": not args.random_init, "eval_data": tuple(args.eval_data),
                                   "variant": variant})


class TrainDisplay:
    """``train``'s progress on stderr: the plan, a bar with the loss and per-step accuracy, evaluations."""

    def __init__(self, cfg: TrainConfig) -> None:
        from rich.console import Console

        self.cfg = cfg
        # soft_wrap: a line is one line in a log file too (rich wraps at 80 columns where stderr is no terminal;
        # gpu_train.sh's probe reads the progress lines)
        self.console = Console(stderr=True, soft_wrap=True)
        self.progress: Any = None
        self.task: Any = None
        # Where stderr is no terminal (a file, a pipe: a long run in the background), a line every LOG_EVERY
        # steps and no bar: rich would print a bar's last frame there
        self.lines = not self.console.is_terminal
        self.window: list[dict[str, Any]] = []
        self.seconds = 0.0  # training time of the window's steps (evaluations left out)
        self.t_last = time.perf_counter()

    def __call__(self, ev: TrainEvent) -> None:
        if isinstance(ev, TrainStarted):
            if ev.resumed_from:
                self.console.print(f"resumed from {ev.resumed_from} at step {ev.step}")
            if ev.precision:
                self.console.print(f"precision: {ev.precision}")
            self.console.print(f"{ev.samples} training samples, {ev.heldout} held out; draft vocab "
                               f"{ev.draft_vocab_size} covers {100 * ev.coverage:.1f}% of assistant tokens; "
                               f"{ev.total_steps} steps ({ev.steps_per_epoch}/epoch)")
            if ev.skipped:
                self.console.print(f"{ev.skipped} training samples skipped: no answer token inside --max-len "
                                   "(raise it to train on them)")
            if not self.lines:
                self._start_bar(ev.total_steps, ev.step)
            self.t_last = time.perf_counter()
        elif isinstance(ev, StepDone):
            r = ev.record
            if self.lines:
                self._log_line(ev)
            else:
                self.progress.update(self.task, advance=1,
                                     info=f"loss {r['loss']:.3f} acc " + " ".join(f"{a:.2f}" for a in r["acc"]))
        elif isinstance(ev, FeatureProgress):
            if ev.done == 1 or ev.done == ev.total or ev.done % 50 == 0:
                self.console.print(f"target features: {ev.done}/{ev.total} batches cached")
        elif isinstance(ev, EvalDone):
            self.t_last = time.perf_counter()  # the evaluation's time is not a step's
            self.console.print(f"step {ev.step}: held-out accept length (chain of {self.cfg.ttt_steps}) "
                                        f"{ev.result.accept_length:.2f}; step acc "
                                        + " ".join(f"{a:.2f}" for a in ev.result.step_acc)
                                        + (f"; best {ev.best_accept_length:.2f} at step {ev.best_step}"
                                           if ev.best_step is not None else "")
                                        + "".join(f"; {name} {a:.2f}" for name, a in ev.others.items())
                                        + ("; stopping: the held-out curve is flat" if ev.stopping else ""))

    def _log_line(self, ev: StepDone) -> None:
        now = time.perf_counter()
        self.window.append(ev.record)
        self.seconds += now - self.t_last
        self.t_last = now
        if ev.step % LOG_EVERY and ev.step != ev.total_steps:
            return
        w = self.window
        acc = " ".join(f"{sum(r['acc'][j] for r in w) / len(w):.3f}" for j in range(len(w[0]["acc"])))
        self.console.print(f"step {ev.step}/{ev.total_steps}: loss {sum(r['loss'] for r in w) / len(w):.3f}, "
                           f"acc {acc} (mean of {len(w)} steps), lr {w[-1]['lr']:.2e}, "
                           f"{self.seconds / len(w):.2f} s/step")
        self.window, self.seconds = [], 0.0

    def _start_bar(self, total: int, completed: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.progress = Progress(*columns, console=self.console)
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=completed, info="")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def run(args: argparse.Namespace) -> int:
    from specdecode.runtime.device import configure_threads
    from specdecode.training.trainer import train

    configure_threads(args.threads)
    cfg = train_config(args)
    display = TrainDisplay(cfg)
    try:
        summary = train(cfg, on_progress=display)
    finally:
        display.close()
    print(json.dumps(summary))
    return 0
