"""Load test for a running `specdecode serve`: N concurrent streaming clients, each sending
R requests one after another; prints (and optionally writes) a JSON summary.

    python benchmarks/tools/load_test.py --url http://127.0.0.1:8000 --clients 16 --requests 4 --out load.json

A request fails on a non-200 status, an in-band error event, or a stream that ends
without a finish_reason and ``data: [DONE]``. Speculative counters come from /metrics
(before and after), so the accept length is the server's own measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter

import httpx

from specdecode.io.prometheus import parse_prometheus


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of a /metrics page (the counters this test reads), by name."""
    return {s.name: s.value for s in parse_prometheus(text) if not s.labels}


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, tag: str) -> dict:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"{args.prompt} ({tag})"}]
    else:
        path, body["prompt"] = "/v1/completions", f"{args.prompt} ({tag})"
    t0 = time.perf_counter()
    ttft = finish = usage = None
    done = False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return {"ok": False, "error": event["error"].get("message")}
                choice = event["choices"][0] if event["choices"] else None
                if choice and ttft is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                    ttft = time.perf_counter() - t0
                if choice and choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                usage = event.get("usage") or usage
    except httpx.HTTPError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    elapsed = time.perf_counter() - t0
    if not (done and finish and usage):
        return {"ok": False, "error": f"incomplete stream (done={done}, finish={finish}, usage={bool(usage)})"}
    return {"ok": True, "ttft_s": ttft if ttft is not None else elapsed, "elapsed_s": elapsed,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as admin:
        model = args.model or (await admin.get("/v1/models")).json()["data"][0]["id"]
        before = parse_metrics((await admin.get("/metrics")).text)

        async def client_loop(i: int) -> list[dict]:
            async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as c:
                return [await one_request(c, args, model, f"client {i}, request {k}") for k in range(args.requests)]

        t0 = time.perf_counter()
        results = [r for per in await asyncio.gather(*(client_loop(i) for i in range(args.clients))) for r in per]
        wall = time.perf_counter() - t0
        try:
            after: dict[str, float] | None = parse_metrics((await admin.get("/metrics")).text)
        except httpx.HTTPError:  # the server is gone (a shutdown under load): no server counters
            after = None
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0) if after is not None else float("nan")

    cycles, drafted, accepted = (delta(f"specdecode_spec_{n}_total")
                                 for n in ("cycles", "draft_tokens", "accepted_tokens"))
    ttfts = sorted(r["ttft_s"] for r in ok)
    return {
        "url": args.url, "model": model, "endpoint": args.endpoint, "clients": args.clients,
        "requests": len(results), "failures": len(results) - len(ok),
        "errors": dict(Counter(r["error"][:120] for r in results if not r["ok"]).most_common(10)),
        "wall_s": wall, "completion_tokens": tokens, "tok_per_s": tokens / wall if wall else float("nan"),
        "ttft_s": {"mean": statistics.fmean(ttfts), "p50": ttfts[len(ttfts) // 2],
                   "p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "max": ttfts[-1]} if ttfts else None,
        "server_generated_tokens": delta("specdecode_generation_tokens_total"),
        "accept_length": 1 + accepted / cycles if cycles else None,
        "accept_rate": accepted / drafted if drafted else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="per client, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--prompt", default="Write a short paragraph about the sea.")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
