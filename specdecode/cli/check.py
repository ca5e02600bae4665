"""`specdecode check`: greedy losslessness of speculative decoding on real prompts
(a front end to ``specdecode.core.lossless.check_lossless``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

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
                                   "first divergence and the top-2 logit gap there.")
    add_prompt_args(p, 64)
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
