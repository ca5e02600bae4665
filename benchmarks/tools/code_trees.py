"""The same `specdecode generate` runs from two source trees (an old commit's worktree and this one),
interleaved: old, new, old, new, ... each a fresh process, so machine drift reaches both alike. What a
refactor must not cost (issue 51: one driver).

    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/tools/code_trees.py --old /tmp/old --new . --repeats 6 \\
        --config plain="--no-spec" --config default="" --prompt "Explain how a bicycle stays upright." \\
        --out benchmarks/results/<folder>/raw/trees.json

Each tree runs with its own checkout first on the path (``python -m specdecode`` from its directory) and the
same environment; background graph builds are off. Reported per config and tree: decode tok/s (tokens after
the first over the time after the first, so model load and prefill are out), median, min and max over the
repeats; the ratio new/old of medians; and the noise: the spread (max/min) of each tree's own repeats.

Prints the table and writes JSON with the environment fingerprint."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(tree: Path, args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "specdecode", "generate", *args, "--json"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: generate {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    n, elapsed, ttft = record["num_tokens"], record["elapsed_s"], record["ttft_s"]
    record["decode_tok_per_s"] = (n - 1) / max(elapsed - ttft, 1e-9)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="the old source tree (a worktree of the old commit)")
    p.add_argument("--new", type=Path, default=Path("."), help="the new source tree (default: here)")
    p.add_argument("--config", action="append", required=True, metavar="NAME=FLAGS",
                   help="a named set of generate flags (repeatable), e.g. plain=\"--no-spec\"")
    p.add_argument("--prompt", default="Explain how a bicycle stays upright, in a few paragraphs.")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    configs = {name: shlex.split(flags) for name, _, flags in (c.partition("=") for c in a.config)}
    trees = {"old": a.old.resolve(), "new": a.new.resolve()}
    env = {**os.environ, "SPECDECODE_BACKGROUND_COMPILE": "0"}
    env.pop("PYTHONPATH", None)
    common = [a.prompt, "--max-new-tokens", str(a.max_new_tokens), "--threads", str(a.threads)]
    runs: dict[str, dict[str, list[dict]]] = {c: {t: [] for t in trees} for c in configs}
    for flags in configs.values():  # one untimed run of each first: caches (kernel plans, cost tables) filled
        for tree in trees.values():
            run_once(tree, common + flags, env)
    for r in range(a.repeats):
        for c, flags in configs.items():
            order = list(trees) if r % 2 == 0 else list(reversed(trees))  # who goes first alternates
            for t in order:
                record = run_once(trees[t], common + flags, env)
                runs[c][t].append(record)
                print(f"repeat {r + 1}/{a.repeats} {c} {t}: {record['decode_tok_per_s']:.1f} tok/s", file=sys.stderr)
    rows = []
    for c in configs:
        speeds = {t: [x["decode_tok_per_s"] for x in runs[c][t]] for t in trees}
        med = {t: statistics.median(v) for t, v in speeds.items()}
        same = all(x["token_ids"] == runs[c]["old"][0]["token_ids"] for t in trees for x in runs[c][t])
        rows.append({"config": c, "flags": configs[c], **{f"{t}_median": med[t] for t in trees},
                     **{f"{t}_min": min(v) for t, v in speeds.items()},
                     **{f"{t}_max": max(v) for t, v in speeds.items()},
                     "ratio_new_old": med["new"] / med["old"],
                     "noise_old": max(speeds["old"]) / min(speeds["old"]),
                     "noise_new": max(speeds["new"]) / min(speeds["new"]),
                     "same_tokens": same, "method": {t: runs[c][t][0]["method"] for t in trees},
                     "graphs_loaded": {t: runs[c][t][0]["graphs_loaded"] for t in trees}})
    print(f"{'config':<10}{'old tok/s':>12}{'new tok/s':>12}{'new/old':>9}{'noise old':>11}{'noise new':>11}"
          "  same tokens")
    for row in rows:
        print(f"{row['config']:<10}{row['old_median']:>12.1f}{row['new_median']:>12.1f}{row['ratio_new_old']:>9.3f}"
              f"{row['noise_old']:>11.3f}{row['noise_new']:>11.3f}  {row['same_tokens']}")
    if a.out:
        from specdecode.bench.fingerprint import capture

        a.out.parent.mkdir(parents=True, exist_ok=True)
        fingerprint = capture(threads=a.threads, dtype="auto", device="cpu", argv=sys.argv)
        a.out.write_text(json.dumps({"rows": rows, "runs": runs, "trees": {t: str(p) for t, p in trees.items()},
                                     "fingerprint": fingerprint}, indent=1, default=str))


if __name__ == "__main__":
    main()
