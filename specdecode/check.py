"""`specdecode check`: greedy losslessness of speculative decoding on a real model.

Speculative greedy output must equal baseline greedy output token for token. Verifying
k tokens in one pass rounds differently from one-at-a-time decoding, so a flip is
acceptable only at a true near-tie: for every divergence we report the position and the
target's top-2 logit gap there, and fail when the gap exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .engine import Engine, GenerateOptions, baseline_decode
from .loading import load_model
from .prompts import encode_prompt, load_prompts
from .runtime import configure_threads, resolve_device


def top2_gap(model, ids: list[int]) -> tuple[float, list[int]]:
    """Logit gap between the best two next tokens after ``ids`` (full forward)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device), torch.arange(len(ids), device=model.device),
                       model.new_cache(1, len(ids)), logits_at=torch.tensor([-1], device=model.device)).logits
    top = logits[0, -1].float().topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def compare(model, prompt_ids: list[int], base: list[int], spec: list[int]) -> dict:
    n = min(len(base), len(spec))
    first = next((i for i in range(n) if base[i] != spec[i]), None)
    if first is None and len(base) == len(spec):
        return {"identical": True}
    if first is None:  # one stopped earlier (EOS vs budget): a difference at index n
        first = n
    gap, top2 = top2_gap(model, prompt_ids + base[:first])
    return {"identical": False, "first_divergence": first, "top2_gap": gap, "top2": top2,
            "baseline_token": base[first] if first < len(base) else None,
            "spec_token": spec[first] if first < len(spec) else None}


def add_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, help="Spec-Bench jsonl or {\"prompt\": ...} jsonl (default: built-in)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--per-category", type=int, default=None, help="use the first N prompts of each category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest top-2 logit gap at which a divergence counts as a near-tie (fp32: 1e-3)")
    p.add_argument("--self-draft", action="store_true",
                   help="draft with the target itself: every proposal must be accepted (checks the machinery)")
    p.add_argument("--out", default=None, help="write per-prompt results as JSON")


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import track

    from .cli import DEFAULT_NUM_STEPS, build_decoder
    from .selfdraft import SelfDrafter
    from .speculative import Eagle3Decoder, SpecConfig

    console = Console(stderr=True)
    configure_threads(args.threads)
    loaded = load_model(args.model, args.dtype, resolve_device(args.device))
    model = loaded.model
    prompts = load_prompts(args.prompts, args.num_prompts, args.per_category)
    base_engine = Engine(model, loaded.tokenizer, baseline_decode)
    if args.self_draft:
        method = "self-draft"
    else:
        decoder, method = build_decoder(args, loaded)
        if decoder is baseline_decode:
            raise ValueError("nothing to check: no drafter (pass --drafter PATH, --drafter random or --self-draft)")
        spec_engine = Engine(model, loaded.tokenizer, decoder)
    options = GenerateOptions(max_new_tokens=args.max_new_tokens)
    rows, accept_lengths = [], []
    for prompt in track(prompts, description="checking", console=console, transient=True):
        ids = encode_prompt(prompt, loaded.tokenizer)
        if args.self_draft:
            config = SpecConfig(args.num_steps or DEFAULT_NUM_STEPS, args.topk, args.num_draft_tokens)
            spec_engine = Engine(model, loaded.tokenizer, Eagle3Decoder(SelfDrafter(model, model, ids[0]), config))
        base = base_engine.generate(ids, options)
        spec = spec_engine.generate(ids, options)
        row = {"prompt_id": prompt.id, "category": prompt.category, "num_tokens": base.num_tokens,
               "accept_length": spec.stats.get("accept_length")} | compare(model, ids, base.token_ids, spec.token_ids)
        rows.append(row)
        if spec.stats:
            accept_lengths.append(spec.stats["accept_length"])
    diverged = [r for r in rows if not r["identical"]]
    bugs = [r for r in diverged if r["top2_gap"] > args.tolerance]
    console.print(f"{method}, {args.dtype}: {len(rows) - len(diverged)}/{len(rows)} prompts identical to the baseline "
                  f"({sum(r['num_tokens'] for r in rows)} tokens); mean accept length "
                  f"{sum(accept_lengths) / max(len(accept_lengths), 1):.2f}", markup=False, highlight=False)
    for r in diverged:
        verdict = "BUG" if r["top2_gap"] > args.tolerance else "near-tie"
        console.print(f"  {r['prompt_id']}: first divergence at token {r['first_divergence']}, top-2 logit gap "
                      f"{r['top2_gap']:.2e} ({verdict}; baseline {r['baseline_token']}, spec {r['spec_token']})",
                      markup=False, highlight=False)
    if args.out:
        Path(args.out).write_text(json.dumps({"method": method, "dtype": args.dtype, "rows": rows}, indent=1))
    if bugs:
        console.print(f"FAILED: {len(bugs)} divergence(s) with a top-2 gap above {args.tolerance}", markup=False)
        return 1
    return 0
