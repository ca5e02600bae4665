"""The few-query attention kernels, alone (issue 47): ms per step of SmolLM2-135M's attention (30 layers, 9 query
heads over 3 KV heads, head 64) for T tokens a row (1: a decode step; more: a verify) over S cached keys, every
loaded kernel alternated with aten's SDPA ROUNDS times in one process.

    .venv/bin/python benchmarks/tools/attention_kernels.py --tokens 1,2,4,8,16 --keys 256 --rounds 5 \\
        --out benchmarks/results/attention-avx512/kernels.json

Prints the table and writes JSON with the environment fingerprint."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.bench.fingerprint import capture
from specdecode.core.attention import NATIVE_ATTENTION, NATIVE_ATTENTION_AVX512
from specdecode.core.kernels import native_loaded
from specdecode.runtime.native import load_native

LAYERS, KV, GROUP, D = 30, 3, 3, 64


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tokens: int) -> torch.Tensor:
    rows = mask.reshape(-1, 1, 1, tokens, k.shape[2]).expand(-1, 1, GROUP, tokens, k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=rows.reshape(-1, 1, GROUP * tokens, k.shape[2]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16", help="query tokens a row, comma-separated")
    p.add_argument("--keys", type=int, default=256, help="cached keys (the last token sees all of them)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="timed steps per kernel, tokens and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/attention-avx512/kernels.json"))
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(args.threads)
    load_native()
    kernels = {"sdpa": sdpa} | {op: getattr(torch.ops.specdecode, op) for op in (NATIVE_ATTENTION,
                                                                                   NATIVE_ATTENTION_AVX512)
                                if native_loaded(op)}
    g = torch.Generator().manual_seed(0)
    cache = [torch.randn(2, KV, args.keys, D, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    ms: dict[int, dict[str, list[float]]] = {t: {name: [] for name in kernels} for t in tokens}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for t in tokens:
                q = torch.randn(1, KV, GROUP * t, D, generator=g).to(torch.bfloat16)
                mask = torch.ones(1, t, args.keys, dtype=torch.bool).tril(args.keys - t)  # causal over the cache
                for name, op in kernels.items():
                    op(q, cache[0][0:1], cache[0][1:2], mask, t)  # warm
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        for layer in cache:
                            op(q, layer[0:1], layer[1:2], mask, t)
                    ms[t][name].append((time.perf_counter() - start) / args.calls * 1e3)
    median = {t: {name: statistics.median(v) for name, v in d.items()} for t, d in ms.items()}
    print(f"ms of attention per step ({LAYERS} layers, {KV * GROUP} heads over {KV}, head {D}, {args.keys} keys, "
          f"{args.threads} threads), median of {args.rounds} alternated rounds")
    print("tokens " + "".join(f"{name:>24}" for name in kernels))
    for t in tokens:
        print(f"{t:>6} " + "".join(f"{median[t][name]:>24.3f}" for name in kernels))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"keys": args.keys, "rounds": args.rounds, "calls": args.calls,
                                    "kernels": list(kernels), "ms": ms, "median_ms": median,
                                    "fingerprint": capture(threads=args.threads, dtype="bfloat16", device="cpu")},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
