"""`specdecode generate`: answer one prompt (streaming, JSON, progress bar, per-phase profile)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    compile_notice,
    decoder_spec,
    notice,
    runtime_config,
    sampling_params,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=SUBCOMMANDS["generate"][1],
                       description="Generate a response to PROMPT (chat template applied unless --raw).")
    p.add_argument("prompt", help="the user message (or plain text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and timings")
    add_model_args(p)
    add_spec_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specdecode.core.engine import Engine
    from specdecode.core.profiler import format_profile
    from specdecode.core.requests import GenerateOptions, StreamChunk
    from specdecode.runtime.background import BACKGROUND_ENV
    from specdecode.runtime.builds import build_missing, builds_after
    from specdecode.runtime.decoders import build_decoder
    from specdecode.runtime.session import start
    from specdecode.runtime.weights import weight_format

    err = Console(stderr=True)
    spec = decoder_spec(args)  # bad flags are refused before the model loads
    options = GenerateOptions(max_new_tokens=args.max_new_tokens, sampling=sampling_params(args),
                              stop=tuple(args.stop))
    t0 = time.perf_counter()
    session = start(runtime_config(args), on_compile=compile_notice, log=notice)
    load_s = time.perf_counter() - t0
    tok = session.loaded.tokenizer
    if args.raw:
        prompt_ids = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt_ids = tok.encode_chat(messages)
    if not args.json:
        err.print(f"format: {session.config.dtype}, {session.config.weights} weights ({session.format_reason})",
                  markup=False, highlight=False)
        if session.compiled is not None:
            err.print(f"compiled steps: {session.compile_reason}", markup=False, highlight=False)
        elif builds_after(session):  # the first run: say what happens next
            err.print("note: the steps run eager: no compiled steps are stored for this model on this machine. After "
                      "this run they are built in the background, and the cycle costs --spec-config auto chooses "
                      "from are timed on them (about 2 minutes on 2 cores; "
                      f"${BACKGROUND_ENV}=0 turns that off, `specdecode compile` builds them in the foreground); "
                      "later runs load them in seconds and decode faster (benchmarks/results/q4-speculation/: eager "
                      "EAGLE-3 at 0.60x of compiled plain decoding)", style="yellow", markup=False, highlight=False,
                      soft_wrap=True)
    if builds_after(session) and session.compiled is None:  # a first run: its build times the cycle costs
        spec = replace(spec, defer_costs=True)
    decoder = build_decoder(spec, session, log=None if args.json else lambda m: err.print(m, markup=False))
    if decoder.choice is not None and not args.json:
        err.print(decoder.choice.summary(), markup=False, highlight=False)
    for note in decoder.notes:
        err.print(f"note: {note}", style="yellow", markup=False, highlight=False)
    engine = Engine(session.loaded.model, tok, decoder.decode, comm=session.comm)

    if args.json:
        result = engine.generate(prompt_ids, options)
    elif args.stream:
        def print_chunk(chunk: StreamChunk) -> None:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

        result = engine.generate(prompt_ids, options, on_chunk=print_chunk)
        sys.stdout.write("\n")
    else:
        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                   TimeElapsedColumn(), TextColumn("{task.fields[rate]}"))
        with Progress(*columns, console=err, transient=True) as progress:
            task = progress.add_task("gen", total=args.max_new_tokens, rate="")
            started = time.perf_counter()
            count = 0

            def on_chunk(chunk: StreamChunk) -> None:
                nonlocal count
                count += len(chunk.token_ids)
                rate = count / max(time.perf_counter() - started, 1e-9)
                progress.update(task, completed=count, rate=f"{rate:.1f} tok/s")

            result = engine.generate(prompt_ids, options, on_chunk=on_chunk)
        print(result.text)

    record = result.to_dict() | {
        "method": decoder.description, "model": str(session.loaded.source), "dtype": session.config.dtype,
        "weights": session.config.weights, "format_reason": session.format_reason,
        "kernels": session.kernels.summary(), "device": str(session.device), "compile": session.compile_reason,
        "graphs_loaded": len(session.compiled.loaded) if session.compiled else 0,
        "threads": session.threads, "load_s": load_s,
        "spec_config": decoder.config.to_dict() if decoder.config else None,
        "spec_choice": decoder.choice.to_dict() if decoder.choice else None, "notes": decoder.notes}
    if args.launch_profile:
        from specdecode.bench.profiles import load_profile

        record["launch_profile"] = load_profile(args.launch_profile).record(session.threads)
        for c in record["launch_profile"]["contradictions"]:
            err.print(f"WARNING: the live environment contradicts launch profile {args.launch_profile!r}: {c}",
                      style="bold red", markup=False)
    if args.profile and result.stats.get("cycles"):
        err.print(format_profile(record), markup=False, highlight=False)
    elif args.profile:  # say why the table is missing, and how to get one
        step_ms = 1000 * (result.elapsed_s - result.ttft_s) / max(result.num_tokens - 1, 1)
        how = "drop --no-spec" if not spec.speculative else "give a shape, e.g. --num-steps 2, to speculate anyway"
        err.print(f"profile: no speculative phases to time: this run decoded plain ({decoder.description}); "
                  f"{step_ms:.2f} ms a token after the first, {1000 * result.ttft_s:.0f} ms to the first. For the "
                  f"EAGLE-3 profile, {how}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    background = build_missing(session, spec, decoder.config, len(prompt_ids) + args.max_new_tokens)
    record["background_compile"] = (asdict(background) | {"log": str(background.log) if background.log else None}
                                    if background is not None else None)
    if background is not None and background.pid is not None and not args.json:
        err.print(f"compiled steps: building the graphs this run ran eager in the background (pid {background.pid}, "
                  f"its output: {background.log}); the next run loads them", markup=False, highlight=False)
    if args.json:
        print(json.dumps(record))
    else:
        weights = f", {session.config.weights} weights" if weight_format(session.config.weights).quantized else ""
        err.print(f"[bold]{result.num_tokens} tokens[/] in {result.elapsed_s:.2f} s: "
                  f"[bold]{result.tok_per_s:.1f} tok/s[/] (prompt {result.prompt_tokens} tokens, "
                  f"time to first token {result.ttft_s * 1000:.0f} ms, finish: {result.finish_reason}; "
                  f"{session.config.dtype}"
                  f"{weights}, "
                  f"{session.device}, {session.threads} threads, model loaded in {load_s:.1f} s)")
        if "allreduce_share" in result.stats:
            err.print(f"tensor parallel: all-reduce {result.stats['allreduce_ms_per_token']:.2f} ms/token "
                      f"({100 * result.stats['allreduce_share']:.1f}% of the time)", markup=False, highlight=False)
        if result.stats.get("cycles"):
            err.print(f"{decoder.description}: accept length {result.stats['accept_length']:.2f}, "
                      f"accept rate {result.stats['accept_rate']:.2f}", markup=False, highlight=False)
    return 0
