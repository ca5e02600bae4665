"""`specdecode formats`: weight formats and dtypes side by side, speed and quality in one run
(a front end to ``specdecode.bench.formats.measure_formats``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.formats import DEFAULT_FORMATS, FormatsConfig
from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_prompt_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = FormatsConfig()
    p = sub.add_parser("formats", help=SUBCOMMANDS["formats"][1],
                       description="For each dtype:weights[:kernels] format (the first is the reference): ms per "
                                   "target forward over k tokens (k=1: a decode step; the verify-cost curve), held-out "
                                   "perplexity and top-1 agreement on --passages, greedy agreement on --prompts.")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="comma-separated dtype:weights[:kernels[:activations]] (weights: native | int8 | q4; "
                        "kernels: auto | static, as --kernels; activations as --activations; "
                        f"default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: as generate)")
    p.add_argument("--passages", default=None,
                   help="prompts file whose texts score perplexity (e.g. ../shared/data/prompts/long/*.jsonl); "
                        "without it no perplexity is measured")
    p.add_argument("--num-passages", type=int, default=d.num_passages, help="passages scored for perplexity")
    p.add_argument("--max-passage-tokens", type=int, default=d.max_passage_tokens,
                   help="tokens of each passage scored")
    add_prompt_args(p, d.max_new_tokens, "greedy-agreement prompts: Spec-Bench jsonl or jsonl of {\"prompt\": ...}")
    p.add_argument("--ks", default=",".join(map(str, d.ks)), help="tokens per timed forward")
    p.add_argument("--context", type=int, default=d.context, help="cached tokens before each timed forward")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed forwards per format and k (the median "
                                                                  "is reported)")
    p.add_argument("--llama-bench", nargs="?", const="auto", default=None, metavar="PATH",
                   help="also time llama.cpp on the same GGUF with llama-bench (a batch of k tokens after --context "
                        "cached: its verify-cost curve beside ours); PATH, or found as llama-server is "
                        "($SPECDECODE_LLAMA_SERVER's directory, the [llamacpp] extra, $PATH)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also score llama.cpp itself on the same GGUF (llama-cpp-python, the [llamacpp] extra): "
                        "perplexity and top-1 agreement on the same passages' tokens, greedy agreement on the same "
                        "prompts, beside our formats")
    p.add_argument("--out", default=None, help="write the result (with the environment fingerprint) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.fingerprint import capture
    from specdecode.bench.formats import measure_formats

    try:
        ks = tuple(int(k) for k in args.ks.split(","))
    except ValueError:
        raise ValueError(f"--ks must be comma-separated integers, got {args.ks!r}") from None
    if any(k < 1 for k in ks) or args.repeats < 1 or args.max_new_tokens < 1:
        raise ValueError("--ks, --repeats and --max-new-tokens must be at least 1")
    config = FormatsConfig(formats=tuple(f for f in args.formats.split(",") if f.strip()), model=args.model,
                           threads=args.threads, passages=args.passages, num_passages=args.num_passages,
                           max_passage_tokens=args.max_passage_tokens, prompts=args.prompts,
                           num_prompts=args.num_prompts, per_category=args.per_category,
                           max_new_tokens=args.max_new_tokens, ks=ks, context=args.context, repeats=args.repeats,
                           llama_bench=args.llama_bench, llama_cpp=args.llama_cpp)
    err = Console(stderr=True)
    result = measure_formats(config, on_progress=lambda msg: err.print(msg, style="dim", markup=False))
    out = Console(width=200)
    speed = Table(title=f"ms per target forward over k tokens ({result['context']} cached, {result['threads']} "
                        "threads; k=1 is a decode step); verify cost = ms(k) / ms(1)")
    speed.add_column("format")
    for k in ks:
        speed.add_column(f"k={k}", justify="right")
    llama = [result["llama_cpp"]] if result["llama_cpp"] else []
    for row in result["rows"] + [r for r in llama if "forward_ms" in r]:
        speed.add_row(row["format"], *(f"{row['forward_ms'][k]:.1f} ({row['verify_cost'][k]:.2f}x)" for k in ks))
    out.print(speed)
    quality = Table(title=f"quality against {result['reference']} (perplexity on --passages; greedy on "
                          f"{result['rows'][0]['greedy_prompts']} prompts x {result['max_new_tokens']} tokens)")
    for col in ("format", "perplexity", "top-1 agreement", "greedy identical", "mean first divergence"):
        quality.add_column(col, justify="right")
    for row in result["rows"] + [r for r in llama if "greedy_prompts" in r]:
        quality.add_row(row["format"], f"{row['perplexity']:.3f}" if "perplexity" in row else "-",
                        f"{row['top1_agreement']:.4f}" if "top1_agreement" in row else "-",
                        f"{row['greedy_identical']}/{row['greedy_prompts']}",
                        "-" if row["mean_first_divergence"] is None else f"{row['mean_first_divergence']:.1f}")
    out.print(quality)
    if args.out:
        fingerprint = capture(threads=result["threads"], dtype="(per format)", device="cpu")
        Path(args.out).write_text(json.dumps({"config": vars(config) | {"ks": list(ks)}, "fingerprint": fingerprint,
                                              **result}, indent=1, default=str))
    return 0
