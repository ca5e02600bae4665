"""The table of benchmarks/archive/serving_concurrency.sh and benchmarks/archive/serve_compiled.sh: one row per server
(or spec policy) and concurrency from the `bench --endpoint` results in a directory ({name}-c{N}.json, or
{name}-r{round}-c{N}.json for repeated rounds: the row is then the median over rounds); Markdown to
stdout and the same rows as JSON beside the directory ({directory name}.json; serving/ writes
serving-concurrency.json). With a second argument, each row's total tok/s against that server's at the
same concurrency.

    python benchmarks/archive/serving_table.py RUNS_DIR
    python benchmarks/archive/serving_table.py RUNS_DIR llama-server
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

POLICIES = ("never", "always", "auto")
NUMBERS = ("total_tok_s", "request_tok_s", "ttft_ms", "tpot_ms", "accept_length", "cached_pct")


def rows(directory: Path, vs: str | None = None) -> list[dict]:
    runs: dict[tuple[str, int], list[dict]] = {}
    for path in directory.glob("*-c*.json"):
        m = re.fullmatch(r"(.+?)(?:-r\d+)?-c(\d+)\.json", path.name)
        if not m:
            continue
        run = json.loads(path.read_text())["remote"][0]
        spec = run.get("server_spec") or {}
        runs.setdefault((m[1], int(m[2])), []).append({
            "ok": run["ok"], "requests": run["requests"], "total_tok_s": run["output_tok_per_s"],
            "request_tok_s": run["request_tok_per_s_median"], "ttft_ms": run["ttft_ms_median"],
            "tpot_ms": run["tpot_ms_median"], "accept_length": spec.get("accept_length"),
            "completion_tokens": run["completion_tokens"],
            "cached_pct": (100 * run["cached_prompt_tokens"] / run["prompt_tokens"]
                           if run.get("cached_prompt_tokens") is not None and run.get("prompt_tokens") else None)})
    out = []
    for (name, concurrency), found in runs.items():
        row = {"policy": name, "concurrency": concurrency, "rounds": len(found),
               "ok": sum(r["ok"] for r in found), "requests": sum(r["requests"] for r in found),
               "completion_tokens": sum(r["completion_tokens"] for r in found)}
        for key in NUMBERS:
            values = [r[key] for r in found if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    out.sort(key=lambda r: (POLICIES.index(r["policy"]) if r["policy"] in POLICIES else 9, r["policy"],
                            r["concurrency"]))
    for r in out:
        one = next((o for o in out if o["policy"] == r["policy"] and o["concurrency"] == 1), None)
        r["total_vs_c1"] = r["total_tok_s"] / one["total_tok_s"] if one else None
        r["ttft_vs_c1"] = r["ttft_ms"] / one["ttft_ms"] if one else None
        ref = next((o for o in out if o["policy"] == vs and o["concurrency"] == r["concurrency"]), None)
        r["total_vs_ref"] = r["total_tok_s"] / ref["total_tok_s"] if ref else None
    return out


def markdown(table: list[dict], vs: str | None = None) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    extra = f" x {vs} |" if vs else ""
    lines = ["| server / policy | concurrency | rounds | ok | total tok/s | x c1 |" + extra + " per-request tok/s | "
             "TTFT ms | TTFT x c1 | TPOT ms | accept len | prompt cached % |",
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if vs else "") + "---:|---:|---:|---:|---:|---:|"]
    for r in table:
        ref = f" {f(r['total_vs_ref'], '.2f')} |" if vs else ""
        lines.append(f"| {r['policy']} | {r['concurrency']} | {r['rounds']} | {r['ok']}/{r['requests']} | "
                     f"{r['total_tok_s']:.1f} | {f(r['total_vs_c1'], '.2f')} |{ref} {r['request_tok_s']:.1f} | "
                     f"{r['ttft_ms']:.0f} | {f(r['ttft_vs_c1'], '.2f')} | {r['tpot_ms']:.1f} | "
                     f"{f(r['accept_length'], '.2f')} | {f(r['cached_pct'], '.0f')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default="benchmarks/results/serving", type=Path,
                        help="the bench --endpoint results ({name}-c{N}.json)")
    parser.add_argument("vs", nargs="?", default=None, help="a server name: each row against it")
    args = parser.parse_args(argv)
    directory, vs = args.directory, args.vs
    table = rows(directory, vs)
    if not table:
        print(f"no {{name}}-c{{N}}.json results in {directory}; run benchmarks/archive/serving_concurrency.sh or "
              "benchmarks/archive/serve_compiled.sh", file=sys.stderr)
        return 1
    name = "serving-concurrency" if directory.name == "serving" else directory.name
    (directory.parent / f"{name}.json").write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table, vs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
