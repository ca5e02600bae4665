"""`specdecode bench`: decoding methods compared on the same prompts, interleaved (a local
model), or an OpenAI-compatible server measured over streaming (``--endpoint``); rich
tables, a progress bar, the results store."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from specdecode.bench.harness import BenchConfig
from specdecode.bench.methods import methods_help
from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import (
    add_model_args,
    add_prompt_args,
    add_store_args,
    compile_notice,
    non_negative_int,
    notice,
    positive_int,
)

_D = BenchConfig()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help=SUBCOMMANDS["bench"][1],
                       description="Compare decoding methods on the same prompts, model, dtype and threads, run by "
                                   "run interleaved so drift hits all alike.")
    p.add_argument("--methods", default=_D.methods,
                   help="comma-separated methods; the first is the reference for speedups. Available: "
                        f"{methods_help()}. E.g. 'baseline,eagle3:steps=2,topk=1,llamaserver,"
                        "llamaserver:spec=eagle3,n_max=2'; compile=on|off: compiled or eager steps for that method "
                        "alone, in the same run")
    p.add_argument("--drafter", default=None, help="drafter for eagle3 methods (default: the shipped one)")
    add_prompt_args(p, _D.max_new_tokens)
    p.add_argument("--max-prompt-words", type=int, default=None, metavar="N",
                   help="use only prompts of at most N words (applied first), e.g. to keep every request "
                        "inside one compiled cache size")
    p.add_argument("--warmup", type=non_negative_int, default=_D.warmup,
                   help="untimed runs per method before measuring")
    p.add_argument("--runs", type=positive_int, default=_D.runs, help="passes over the prompt set")
    p.add_argument("--out", default=None,
                   help="also write the run to FILE: .jsonl appends a run line and one line per record; "
                        "other names get one JSON document")
    add_store_args(p, "the run")
    p.add_argument("--baseline-from", default=None, metavar="RUN",
                   help="take the baseline from a stored run (id, prefix, 'latest' or results file) instead of "
                        "measuring it; refused when that run's environment differs in a performance-relevant way")
    p.add_argument("--allow-env-mismatch", action="store_true",
                   help="with --baseline-from: compare anyway, with a loud warning and the differences recorded")
    p.add_argument("--op-profile", action="store_true",
                   help="also profile aten ops over one baseline generation and print the top ops")
    r = p.add_argument_group("remote mode (any OpenAI-compatible server: ours, SGLang, vLLM, llama.cpp)")
    r.add_argument("--endpoint", default=None, metavar="URL",
                   help="measure the server at URL over streaming instead of a local model: TTFT, TPOT, ITL, "
                        "output tok/s, failures, and the server's own speculative metrics")
    r.add_argument("--endpoint-model", default=None, help="model name to request (default: the first of /v1/models)")
    r.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="the route requested: /v1/chat/completions or /v1/completions")
    r.add_argument("--concurrency", default=None, metavar="N[,N...]",
                   help="requests in flight at once (remote: one value, default 1); without --endpoint, a list "
                        "such as 1,2,4,8 runs the prompts through continuous batching in this process instead of "
                        "the per-prompt comparison: total and per-request tok/s, TTFT, TPOT per spec policy")
    r.add_argument("--spec-policy", default="never,always,auto", metavar="POLICY[,POLICY...]",
                   help="local --concurrency runs: spec policies to measure (default: never,always,auto)")
    r.add_argument("--api-key", default=None, help="bearer token (default: $SPECDECODE_API_KEY or $OPENAI_API_KEY)")
    r.add_argument("--temperature", type=float, default=0.0, help="remote mode's sampling temperature (0: greedy)")
    add_model_args(p)
    p.set_defaults(func=run)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(prompts=args.prompts, num_prompts=args.num_prompts, per_category=args.per_category,
                       max_prompt_words=args.max_prompt_words, max_new_tokens=args.max_new_tokens, runs=args.runs,
                       warmup=args.warmup, drafter=args.drafter, launch_profile=args.launch_profile,
                       methods=args.methods, op_profile=args.op_profile)


def _stdout_console() -> Any:
    from rich.console import Console

    return Console(width=170) if not sys.stdout.isatty() else Console()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from specdecode.bench.harness import measure, prepare_bench, profile_contradictions, stored_baseline
    from specdecode.bench.store import ResultsStore, Run, new_run_id, now
    from specdecode.cli.common import runtime_config, save_and_report, warn_if_building
    from specdecode.runtime.session import start

    console = Console(stderr=True)
    concurrency = parse_int_list(args.concurrency or "1", "--concurrency")
    warn_if_building(console)
    if args.endpoint:
        if len(concurrency) != 1:
            raise ValueError(f"--endpoint measures one concurrency per run; got {args.concurrency}")
        args.concurrency = concurrency[0]
        return run_remote(args, console)
    if args.concurrency is not None:
        return run_batched(args, concurrency, console)
    config = bench_config(args)  # checks the methods before anything loads
    session = start(runtime_config(args), on_compile=compile_notice, log=notice)
    bench = prepare_bench(config, session)
    for w in profile_contradictions(bench.fingerprint):
        print(w, file=sys.stderr)
    store = None if args.no_store else ResultsStore(args.store)

    reference = None
    warnings: list[str] = []
    if args.baseline_from:
        name, records, warnings = stored_baseline(args.baseline_from, store or ResultsStore(args.store),
                                                  bench.fingerprint, args.allow_env_mismatch,
                                                  {p.id for p in bench.prompts})
        reference = (name, records)
        bench.fingerprint["baseline_from"] = {"run": name.split("@", 1)[1], "warnings": warnings}
    for w in warnings:
        console.print(w, style="bold red", markup=False, highlight=False)

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=bench.progress_total)
        result = measure(bench, reference, on_progress=lambda: progress.advance(task))
    tp = session.world_size
    title = (f"specdecode bench: {len(bench.prompts)} prompts x {args.runs} runs, {args.max_new_tokens} new tokens, "
             f"{session.dtype}, {session.threads} threads{f' per rank, tensor parallel {tp}' if tp > 1 else ''}, "
             f"{session.device}")
    out = _stdout_console()
    out.print(summary_table(title, result.summary))
    if result.meta.get("spec_choices"):
        out.print(choice_table(result.meta["spec_choices"], result.summary))
    if len(result.by_category) > 1:
        out.print(category_table(result.by_category))
    if "op_profile" in result.meta:
        out.print(op_table(result.meta["op_profile"]))
    if session.is_main:  # tensor parallel: every rank measured the same run; rank 0 writes it
        save_and_report(Run(new_run_id(), "bench", now(), bench.fingerprint, result.summary, result.records,
                            result.meta), store, args.out, console)
    for w in warnings:  # again at the end, where the eye lands
        console.print(w, style="bold red", markup=False, highlight=False)
    return 0


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by commas, e.g. 1,2,4; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} values must be >= 1; got {text!r}")
    return values


def run_batched(args: argparse.Namespace, concurrency: list[int], console: Any) -> int:
    """``bench --concurrency 1,2,4`` without ``--endpoint``: continuous batching in this process."""
    from rich.progress import Progress
    from rich.table import Table

    from specdecode.bench.batched import measure_batched, same_outputs
    from specdecode.bench.harness import run_fingerprint
    from specdecode.bench.store import ResultsStore, Run, new_run_id, now
    from specdecode.cli.common import runtime_config, save_and_report
    from specdecode.core.specpolicy import SPEC_POLICIES
    from specdecode.io.prompts import encode_prompt
    from specdecode.runtime.decoders import DecoderSpec, build_decoder
    from specdecode.runtime.session import on_passing_thread, start

    policies = [p.strip() for p in args.spec_policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in SPEC_POLICIES]
    if bad or not policies:
        raise ValueError(f"--spec-policy takes {', '.join(SPEC_POLICIES)} separated by commas; "
                         f"got {args.spec_policy!r}")
    if args.baseline_from or args.op_profile or args.runs != 1:
        raise ValueError("--baseline-from, --op-profile and --runs are for the per-prompt comparison; drop them "
                         "with a local --concurrency run")
    config = bench_config(args)
    prompts = config.load_prompts()
    runtime = runtime_config(args)

    def load():
        session = start(runtime, on_compile=compile_notice, log=notice)
        return session, build_decoder(DecoderSpec(drafter=args.drafter, allow_plain=False), session)

    # the model loads on a thread that ends: this thread then owns torch's only OpenMP team
    session, decoder = on_passing_thread(load, runtime.device)
    ids = [encode_prompt(p, session.loaded.tokenizer) for p in prompts]
    if not decoder.is_speculative:
        policies = ["never"]
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("requests", total=len(ids) * len(policies) * len(concurrency))
        for policy in policies:
            for c in concurrency:
                if args.warmup:
                    measure_batched(session, decoder, ids[:min(c, len(ids))], 16, c, policy)
                rows.append(measure_batched(session, decoder, ids, args.max_new_tokens, c, policy,
                                            on_done=lambda: progress.advance(task)))
    reference = rows[0]["outputs"]  # greedy: every policy and concurrency must give the first row's tokens
    for row in rows:
        row["same_output"] = same_outputs(reference, row.pop("outputs"))
    for row in rows:
        one = next((r for r in rows if r["policy"] == row["policy"] and r["concurrency"] == 1), None)
        row["total_vs_c1"] = row["output_tok_per_s"] / one["output_tok_per_s"] if one else None
        row["ttft_vs_c1"] = row["ttft_ms_median"] / one["ttft_ms_median"] if one else None
    table = Table(title=f"specdecode bench --concurrency (in process, continuous batching): {len(ids)} prompts, "
                        f"{args.max_new_tokens} new tokens, {session.dtype}, {session.threads} threads, "
                        f"{decoder.description}")
    for col in ("policy", "concurrency", "total tok/s", "x c1", "per-request tok/s", "TTFT ms", "TTFT x c1",
                "TPOT ms", "batch", "step ms", "prefill %", "spec steps", "accept len", "same output"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        table.add_row(r["policy"], str(r["concurrency"]), f"{r['output_tok_per_s']:.1f}",
                      _fmt_opt(r["total_vs_c1"], ".2f"), f"{r['request_tok_per_s_median']:.1f}",
                      f"{r['ttft_ms_median']:.0f}", _fmt_opt(r["ttft_vs_c1"], ".2f"), f"{r['tpot_ms_median']:.1f}",
                      f"{r['batch_mean']:.1f}", f"{r['step_ms_mean']:.1f}", f"{100 * r['prefill_share']:.0f}%",
                      f"{100 * r['spec_step_share']:.0f}%",
                      _fmt_opt(r["accept_length"], ".2f"), r["same_output"])
    _stdout_console().print(table)
    console.print(f"same output: prompts whose greedy tokens equal the first row's ({rows[0]['policy']}, "
                  f"concurrency {rows[0]['concurrency']}); in float32 every row must be n/n, in bfloat16 near-ties "
                  "can flip (docs/reproducibility.md); step ms: a decode step (every row of the batch), "
                  "prefill %: the share of the run spent on prompt chunks between steps")
    fingerprint = run_fingerprint(session, [decoder.drafter_path] if decoder.drafter_path else [],
                                  drafter_weights=[decoder.drafter_weights] if decoder.drafter_weights else [])
    save_and_report(Run(new_run_id(), "bench-batched", now(), fingerprint, rows, [],
                        {"max_new_tokens": args.max_new_tokens, "prompts": len(ids), "decoder": decoder.description}),
                    None if args.no_store else ResultsStore(args.store), args.out, console)
    return 0


def run_remote(args: argparse.Namespace, console: Any) -> int:
    """``bench --endpoint``: the same prompts, runs, table and store, over HTTP streaming."""
    from rich.progress import Progress
    from rich.table import Table

    from specdecode.bench.remote.benchmark import EndpointConfig, bench_endpoint, link_launch
    from specdecode.bench.store import ResultsStore
    from specdecode.cli.common import save_and_report
    from specdecode.runtime.distributed import is_main_process

    if args.baseline_from or args.op_profile:
        raise ValueError("--baseline-from and --op-profile measure a local model; drop them with --endpoint")
    config = bench_config(args)
    prompts = config.load_prompts()
    api_key = args.api_key or os.environ.get("SPECDECODE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    endpoint = EndpointConfig(args.endpoint, args.endpoint_model, args.api, args.concurrency, api_key,
                              args.temperature)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("requests", total=len(prompts) * args.runs)
        result = bench_endpoint(endpoint, config, prompts, on_done=lambda _: progress.advance(task))
    out = _stdout_console()
    out.print(summary_table(f"specdecode bench --endpoint {args.endpoint}: {len(prompts)} prompts x {args.runs} "
                            f"runs, {args.max_new_tokens} new tokens, concurrency {args.concurrency}",
                            result.summary))
    table = Table(title="remote: per run (client-side timing; server's speculative counters as deltas)")
    for col in ("run", "ok/requests", "output tok/s", "tokens from", "TTFT ms med/p90/p99", "TPOT ms",
                "ITL ms med/p90/p99", "server accept len", "accept rate", "per position"):
        table.add_column(col, justify="right")
    for s in result.remote:
        spec = s["server_spec"] or {}
        f = lambda *keys, s=s: "/".join("-" if s[k] is None else f"{s[k]:.0f}" for k in keys)  # noqa: E731
        table.add_row(str(s["run"]), f"{s['ok']}/{s['requests']}",
                      "-" if s["output_tok_per_s"] is None else f"{s['output_tok_per_s']:.1f}",
                      s["tokens_source"] or "-", f("ttft_ms_median", "ttft_ms_p90", "ttft_ms_p99"),
                      "-" if s["tpot_ms_median"] is None else f"{s['tpot_ms_median']:.1f}",
                      f("itl_ms_median", "itl_ms_p90", "itl_ms_p99"),
                      "-" if spec.get("accept_length") is None else f"{spec['accept_length']:.2f}",
                      "-" if spec.get("accept_rate") is None else f"{spec['accept_rate']:.2f}",
                      " ".join(f"{x:.2f}" for x in spec.get("per_position") or []) or
                      (s["server_spec_reason"] or "-")[:40])
    out.print(table)
    if result.failed:
        console.print(f"{result.failed} failed request(s): " + "; ".join(f"{v}x {k}" for k, v in result.errors.items()),
                      style="bold red", markup=False)
    for hint in result.hints:
        console.print("note: " + hint, style="yellow", markup=False, highlight=False, soft_wrap=True)
    store = None if args.no_store else ResultsStore(args.store)
    launched = link_launch(result.fingerprint, store) if store is not None else None
    if launched:
        console.print(f"the server's launch: run {launched} (its command and the engine's versions)", style="dim",
                      markup=False)
    if is_main_process():
        save_and_report(result.to_run(), store, args.out, console)
    return 0 if not result.failed else 1


def _fmt_speedup(row: dict) -> str:
    lo, hi = row["speedup_ci95"]
    return f"{row['speedup']:.2f}x" + ("" if math.isnan(lo) else f" ({lo:.2f}-{hi:.2f})")


def _fmt_opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


SUMMARY_COLUMNS = ("tok/s median", "min", "max", "ms/token", "TPOT ms", "TTFT ms", "speedup (95% CI)",
                   "accept len", "accept rate", "same output")


def _summary_cells(row: dict) -> list[str]:
    return [f"{row['tok_per_s_median']:.1f}", f"{row['tok_per_s_min']:.1f}", f"{row['tok_per_s_max']:.1f}",
            f"{row['ms_per_token_median']:.1f}", _fmt_opt(row.get("tpot_ms_median"), ".1f"),
            f"{row['ttft_ms_median']:.0f}", _fmt_speedup(row),
            f"{row['accept_length']:.2f}" if "accept_length" in row else "-",
            f"{row['accept_rate']:.2f}" if "accept_rate" in row else "-", row["outputs_match_baseline"]]


def summary_table(title: str, summary: list[dict]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("method")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="right")
    for row in summary:
        table.add_row(row["method"], *_summary_cells(row))
    return table


def choice_table(choices: dict[str, dict], summary: list[dict]) -> Any:
    """How each EAGLE-3 method's shape was chosen, and the cost model's prediction beside the measured
    (the prediction prices decode cycles only; the measured speed includes the prefill)."""
    from rich.table import Table

    rows = {r["method"]: r for r in summary}
    table = Table(title="speculative shapes: how chosen, predicted vs measured")
    for col in ("method", "shape (steps/top-k/tokens)", "how", "accept len pred.", "accept len meas.",
                "speedup pred.", "speedup meas.", "pred. / meas."):
        table.add_column(col, justify="left" if col in ("method", "how") else "right")
    for name, c in choices.items():
        row = rows.get(name, {})
        pred, meas = c.get("predicted_speedup"), row.get("speedup")
        table.add_row(name, f"{c['num_steps']}/{c['topk']}/{c['num_draft_tokens']}", c["how"],
                      _fmt_opt(c.get("predicted_accept_length"), ".2f"), _fmt_opt(row.get("accept_length"), ".2f"),
                      _fmt_opt(pred, ".2f"), _fmt_opt(meas, ".2f"),
                      "-" if pred is None or not meas else f"{pred / meas:.2f}")
    return table


def category_table(by_category: dict[str, list[dict]]) -> Any:
    from rich.table import Table

    table = Table(title="per category")
    table.add_column("category")
    table.add_column("method")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="right")
    for c, rows in by_category.items():
        for i, row in enumerate(rows):
            table.add_row(c if i == 0 else "", row["method"], *_summary_cells(row), end_section=i == len(rows) - 1)
    return table


def op_table(ops: list[dict]) -> Any:
    from rich.table import Table

    table = Table(title="baseline decode: self time per op")
    for col in ("op", "ms/token", "share", "calls"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for o in ops:
        table.add_row(o["op"], f"{o['self_ms_per_token']:.2f}", f"{100 * o['share']:.1f}%", str(o["calls"]))
    return table
