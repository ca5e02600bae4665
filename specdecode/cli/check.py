"""`specdecode check`: greedy losslessness of speculative decoding on real prompts
(a front end to ``specdecode.core.lossless.check_lossless``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import (
    add_model_args,
    add_prompt_args,
    add_spec_args,
    compile_notice,
    decoder_spec,
    non_negative_float,
    notice,
    runtime_config,
)
from specdecode.core.lossless import TOLERANCES
from specdecode.core.speculative import SpecConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help=SUBCOMMANDS["check"][1],
                       description="Compare speculative and baseline greedy output token by token; report the "
                                   "first divergence and the top-2 logit gap there. With --endpoint: whether a "
                                   "running server gives a request the same answer alone, repeated, streamed or "
                                   "not, and sent N times at once (greedy and seeded).")
    add_prompt_args(p, 64)
    g = p.add_argument_group("a running server (--endpoint)")
    g.add_argument("--endpoint", default=None, metavar="URL",
                   help="check a running OpenAI-compatible server instead of decoding here (the model flags do not "
                        "apply): each prompt greedy and seeded, streamed alone (the reference), not streamed, again, "
                        "and --copies at once; exit 1 where an answer differs from its reference")
    g.add_argument("--copies", default="4,16", help="requests sent at once, comma-separated (default: 4,16)")
    g.add_argument("--seed", type=int, default=1234, help="the seeded requests' seed (temperature 0.8; default: 1234)")
    g.add_argument("--api-key", default=None, help="the server's API key (default: $SPECDECODE_API_KEY)")
    p.add_argument("--tolerance", type=non_negative_float, default=None,
                   help="largest top-2 logit gap at which a divergence counts as a near-tie, not a bug "
                        "(default per dtype, measured: " + ", ".join(
                            f"{str(d).removeprefix('torch.')} {t:g}" for d, t in TOLERANCES.items()) + ")")
    p.add_argument("--self-draft", action="store_true",
                   help="draft with the target itself: every proposal must be accepted (checks the machinery)")
    p.add_argument("--out", default=None, help="write per-prompt results as JSON")
    add_model_args(p, default_dtype="float32",
                   dtype_note=": check asks whether speculative output is exactly the baseline's, which holds "
                              "token for token in float32 only; --dtype auto checks the fast default format "
                              "against its near-tie tolerance")
    add_spec_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from specdecode.core.lossless import check_lossless, self_draft_decoder
    from specdecode.io.prompts import encode_prompt, load_prompts
    from specdecode.runtime.decoders import build_decoder
    from specdecode.runtime.session import start

    console = Console(stderr=True)
    if args.endpoint:
        return run_endpoint(args, console)
    spec = replace(decoder_spec(args), allow_plain=False)  # bad flags are refused before the model loads
    session = start(runtime_config(args), on_compile=compile_notice, log=notice)
    model, tokenizer = session.loaded.model, session.loaded.tokenizer
    if args.self_draft:
        method, decoder_for = "self-draft", self_draft_decoder(
            model, spec.config if isinstance(spec.config, SpecConfig) else spec.config.static(), session.runner)
    else:
        decoder = build_decoder(spec, session)
        if not decoder.is_speculative:
            raise ValueError("nothing to check: no drafter (pass --drafter PATH, --drafter random or --self-draft)")
        method = decoder.description
        decoder_for = lambda ids: decoder.decode  # noqa: E731
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    encoded = [(p.id, p.category, encode_prompt(p, tokenizer)) for p in prompts]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("checking", total=len(encoded))
        report = check_lossless(model, tokenizer, decoder_for, encoded, args.max_new_tokens, args.tolerance,
                                on_prompt=lambda row: progress.advance(task), runner=session.runner)
    rows = report.rows
    mean = report.mean_accept_length
    agreement = report.agreement()
    console.print(f"{method}, {session.config.dtype}: {report.identical}/{len(rows)} prompts identical to the "
                  f"baseline ({agreement['tokens']} tokens); mean accept length "
                  f"{mean if mean is not None else 0:.2f}", markup=False, highlight=False)
    if report.diverged:
        a = agreement
        console.print(f"{len(report.diverged)} diverged: first divergence at token {a['mean_first_divergence']:.1f} "
                      f"on average (median {a['median_first_divergence']:g}); top-2 logit gap there: median "
                      f"{a['median_top2_gap']:.3g}, max {a['max_top2_gap']:.3g} (tolerance "
                      f"{report.tolerance:g})", markup=False, highlight=False)
    for r in report.diverged:
        verdict = "BUG" if r["top2_gap"] > report.tolerance else "near-tie"
        console.print(f"  {r['prompt_id']}: first divergence at token {r['first_divergence']}, top-2 logit gap "
                      f"{r['top2_gap']:.2e} ({verdict}; baseline {r['baseline_token']}, spec {r['spec_token']})",
                      markup=False, highlight=False)
    if args.out:
        Path(args.out).write_text(json.dumps({"method": method, "dtype": session.config.dtype,
                                              "agreement": agreement, "rows": rows}, indent=1))
    if report.bugs:
        console.print(f"FAILED: {len(report.bugs)} divergence(s) with a top-2 gap above {report.tolerance:g}",
                      markup=False)
        return 1
    return 0


def run_endpoint(args: argparse.Namespace, console: Any) -> int:
    """``check --endpoint``: ``bench.remote.consistency.check_endpoint``, a table per mode, JSON with --out."""
    import os

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from specdecode.bench.remote.consistency import ConsistencyConfig, check_endpoint
    from specdecode.bench.remote.run import RemoteError
    from specdecode.cli.bench import parse_int_list
    from specdecode.io.prompts import load_prompts

    config = ConsistencyConfig(copies=tuple(parse_int_list(args.copies, "--copies")),
                               max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("checking", total=2 * len(prompts))
        try:
            report = check_endpoint(args.endpoint, prompts, config,
                                    api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY"),
                                    on_prompt=lambda _: progress.advance(task))
        except RemoteError as e:
            raise ValueError(f"{e} (is the server at {args.endpoint} running?)") from None
    table = Table(title=f"{report.model} at {report.endpoint}: prompts whose every answer equals its reference "
                        f"(the first, streamed alone), {config.max_new_tokens} new tokens")
    ways = report.ways()
    for col in ("mode", "prompts", *ways, "all", "failed requests"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    rows = report.table()
    for r in rows:
        table.add_row(r["mode"], str(r["prompts"]), *(f"{r[w]}/{r['prompts']}" for w in ways),
                      f"{r['all']}/{r['prompts']}", str(r["errors"]))
    Console(width=170).print(table)
    for c in report.checks:
        for way, text in c.first_other.items():
            console.print(f"  {c.prompt_id} {c.mode}, {way}: {c.same[way]}/{c.sent[way]} equal; one other answer "
                          f"starts {text[:60]!r}, the reference {c.reference[:60]!r}", markup=False, highlight=False)
    if args.out:
        Path(args.out).write_text(json.dumps(report.to_dict(), indent=1))
    inconsistent = sum(not c.consistent for c in report.checks)
    if inconsistent:
        console.print(f"FAILED: {inconsistent} of {len(report.checks)} prompt checks got another answer (or an "
                      f"error) somewhere", markup=False)
        return 1
    return 0
