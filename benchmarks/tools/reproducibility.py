"""The same request, the same answer? Per format (dtype + weights) and decoding mode (plain steps, as
`serve --spec-policy never`; speculative steps, as `always`; `auto` is one of the two per batch size,
fixed when the server starts): greedy repeated alone, seeded sampling repeated, greedy batched with
other requests against alone, and speculative against plain. Prints a table and writes JSON
(``specdecode.bench.repro`` has the definitions).

    .venv/bin/python benchmarks/tools/reproducibility.py --prompts ../shared/data/spec_bench_questions.jsonl \
        --per-category 1 --max-new-tokens 64 --out benchmarks/results/reproducibility

Steps run eager (`--compile off`): compiled graphs round bf16 differently from eager ones, which is one
more way to decode (README: "Compiled steps").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from specdecode.bench.fingerprint import capture
from specdecode.bench.repro import ModeResult, ReproConfig, measure
from specdecode.core.speculative import SpecConfig
from specdecode.io.prompts import encode_prompt, load_prompts
from specdecode.runtime.decoders import DecoderSpec, build_decoder
from specdecode.runtime.session import RuntimeConfig, start

COLUMNS = ("repeat", "seeded", "batched", "vs_plain")
SPEEDS = ("alone_tok_s", "batched_tok_s")


def row_cells(result: ModeResult) -> list[str]:
    cells = []
    for name in COLUMNS:
        a = getattr(result, name)
        if a is None:
            cells.append("-")
        else:
            diff = sorted(a.first_difference)
            cells.append(f"{a}" + (f" (first diff at {diff[len(diff) // 2]}, median)" if diff else ""))
    return cells + [f"{getattr(result, name):.1f}" for name in SPEEDS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="float32:native,bfloat16:native,bfloat16:q4",
                   help="DTYPE:WEIGHTS,... (default: float32:native,bfloat16:native,bfloat16:q4)")
    p.add_argument("--prompts", default=None, help="prompt file (default: the built-in prompts)")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=SpecConfig().num_steps)
    p.add_argument("--topk", type=int, default=SpecConfig().topk)
    p.add_argument("--num-draft-tokens", type=int, default=SpecConfig().num_draft_tokens)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-invariant", action="store_true",
                   help="also measure serve's --batch-invariant engine (alone = one request in the batch's pool)")
    p.add_argument("--out", default=None, help="directory for reproducibility.json and .md")
    args = p.parse_args()

    configs = [ReproConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, batch=args.batch)]
    if args.batch_invariant:
        configs.append(replace(configs[0], batch_invariant=True))
    cfg = configs[0]
    spec = SpecConfig(args.num_steps, args.topk, args.num_draft_tokens)
    prompts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    records, lines = [], []
    header = "| format | mode | " + " | ".join(COLUMNS) + " | tok/s alone | tok/s batched |"
    lines += [f"{len(prompts)} prompts x {cfg.max_new_tokens} tokens; greedy alone x{cfg.repeats}, seeded "
              f"(temperature {cfg.temperature}) alone x2, greedy in a batch of {cfg.batch}; speculative shape "
              f"{spec.num_steps} steps, top-{spec.topk}, {spec.num_draft_tokens} tokens; eager steps, "
              f"{args.threads} threads. Cells: prompts whose outputs were identical; tok/s: generated tokens per "
              "second of the first alone pass and of the batched pass (sequential passes, not interleaved).", "",
              header, "|" + "---|" * (len(COLUMNS) + 4)]
    fingerprint = None
    for fmt in args.formats.split(","):
        dtype, weights = fmt.split(":")
        session = start(RuntimeConfig(dtype=dtype, weights=weights, compile="off", threads=args.threads),
                        log=lambda m: print(m, file=sys.stderr))
        decoder = build_decoder(DecoderSpec(config=spec), session)
        ids = [encode_prompt(pr, session.loaded.tokenizer) for pr in prompts]
        for c in configs:
            t0 = time.perf_counter()
            results = measure(session.loaded.model, ids, session.loaded.tokenizer.eos_token_ids,
                              decoder.decode.drafter, decoder.decode.spec, c,
                              on_progress=lambda m, f=fmt: print(f"{f} {m}", file=sys.stderr, flush=True),
                              runner=session.runner)
            seconds = time.perf_counter() - t0
            kind = " (batch-invariant)" if c.batch_invariant else ""
            for r in results:
                lines.append(f"| {dtype} + {weights} | {r.mode}{kind} | " + " | ".join(row_cells(r)) + " |")
                records.append({"dtype": dtype, "weights": weights, "batch_invariant": c.batch_invariant,
                                "seconds": seconds, **r.as_dict()})
                print(lines[-1], file=sys.stderr)
        fingerprint = capture(threads=session.threads, dtype=dtype, device="cpu", weights=weights,
                              model_path=str(session.loaded.source), argv=sys.argv)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "reproducibility.md").write_text("\n".join(lines) + "\n")
        (out / "reproducibility.json").write_text(json.dumps(
            {"config": vars(args), "results": records, "fingerprint": fingerprint}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
