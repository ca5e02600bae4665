"""The table of benchmarks/serving_concurrency.sh: one row per spec policy and concurrency from
the `bench --endpoint` results in a directory ({policy}-c{N}.json); Markdown to stdout and
the same rows as JSON beside the directory (serving-concurrency.json).

    python benchmarks/serving_table.py benchmarks/results/serving
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def rows(directory: Path) -> list[dict]:
    out = []
    for path in directory.glob("*-c*.json"):
        m = re.fullmatch(r"(\w+)-c(\d+)\.json", path.name)
        if not m:
            continue
        run = json.loads(path.read_text())["remote"][0]
        spec = run.get("server_spec") or {}
        out.append({"policy": m[1], "concurrency": int(m[2]), "ok": run["ok"], "requests": run["requests"],
                    "total_tok_s": run["output_tok_per_s"], "request_tok_s": run["request_tok_per_s_median"],
                    "ttft_ms": run["ttft_ms_median"], "tpot_ms": run["tpot_ms_median"],
                    "accept_length": spec.get("accept_length"), "completion_tokens": run["completion_tokens"]})
    out.sort(key=lambda r: (["never", "always", "auto"].index(r["policy"]) if r["policy"] in
                            ("never", "always", "auto") else 9, r["concurrency"]))
    for r in out:
        one = next((o for o in out if o["policy"] == r["policy"] and o["concurrency"] == 1), None)
        r["total_vs_c1"] = r["total_tok_s"] / one["total_tok_s"] if one else None
        r["ttft_vs_c1"] = r["ttft_ms"] / one["ttft_ms"] if one else None
    return out


def markdown(table: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| policy | concurrency | ok | total tok/s | x c1 | per-request tok/s | TTFT ms | TTFT x c1 | TPOT ms "
             "| accept len |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['policy']} | {r['concurrency']} | {r['ok']}/{r['requests']} | {r['total_tok_s']:.1f} | "
                     f"{f(r['total_vs_c1'], '.2f')} | {r['request_tok_s']:.1f} | {r['ttft_ms']:.0f} | "
                     f"{f(r['ttft_vs_c1'], '.2f')} | {r['tpot_ms']:.1f} | {f(r['accept_length'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    directory = Path(argv[0] if argv else "benchmarks/results/serving")
    table = rows(directory)
    if not table:
        print(f"no {{policy}}-c{{N}}.json results in {directory}; run benchmarks/serving_concurrency.sh",
              file=sys.stderr)
        return 1
    (directory.parent / "serving-concurrency.json").write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
