"""Time to first token of a short request sent while a long prompt is being prefilled, against a
running `specdecode serve` (issue 26: a short request waited 17.6 s behind a 7001-token prompt when
prefill was first come, first served). Prints a table and writes JSON.

    .venv/bin/specdecode serve --port 8123 --compile off &
    .venv/bin/python benchmarks/tools/mixed_ttft.py --url http://127.0.0.1:8123 --out mixed-ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import httpx


def stream_ttft(base: str, model: str, prompt: str, max_tokens: int, out: dict, key: str,
                headers: dict[str, str]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    out.setdefault(key + "_ttft_s", time.perf_counter() - t0)
    out[key + "_total_s"] = time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8123")
    p.add_argument("--long-words", type=int, default=7000, help="words in the long prompt (about a token each)")
    p.add_argument("--delay", type=float, default=0.5, help="seconds between the long request and the short one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="the server's key (default: $SPECDECODE_API_KEY)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    listed = httpx.get(args.url + "/v1/models", headers=headers, timeout=30)
    listed.raise_for_status()
    model = listed.json()["data"][0]["id"]
    rounds = []
    for _ in range(args.rounds):
        res: dict = {}
        long = threading.Thread(target=stream_ttft, args=(args.url, model, "word " * args.long_words, 8, res, "long",
                                                             headers))
        long.start()
        time.sleep(args.delay)
        stream_ttft(args.url, model, "Say hi.", 8, res, "short", headers)
        long.join()
        rounds.append(res)
    print("| round | short TTFT s | long TTFT s | long total s |\n|---|---:|---:|---:|")
    for i, r in enumerate(rounds):
        print(f"| {i} | {r.get('short_ttft_s', float('nan')):.2f} | {r.get('long_ttft_s', float('nan')):.2f} | "
              f"{r['long_total_s']:.2f} |")
    summary = {"short_ttft_s_median": statistics.median(r.get("short_ttft_s", float("nan")) for r in rounds),
               "long_ttft_s_median": statistics.median(r.get("long_ttft_s", float("nan")) for r in rounds),
               "rounds": rounds, "config": vars(args)}
    print(json.dumps({k: v for k, v in summary.items() if k.endswith("median")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
