"""`specdecode compare A B`: did speed change beyond noise, and which hidden variable differs
(a front end to ``specdecode.bench.compare.compare_runs``)."""

from __future__ import annotations

import argparse
import json

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help=SUBCOMMANDS["compare"][1],
                       description="Per method, the B/A speed ratio with a 95% CI and a p-value (paired by prompt "
                                   "when possible), and the fingerprint differences ranked by likely impact; a change "
                                   "beyond noise in a changed environment is reported first.")
    p.add_argument("a", help="run id (or prefix, or 'latest') in the results store, or a results file "
                             "(F.jsonl, F.jsonl#RUN_ID, bench JSON)")
    p.add_argument("b", help="the run to compare against A (same forms)")
    add_store_args(p, writes=False)
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=run)


def _clip(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdecode.bench.compare import compare_runs
    from specdecode.bench.fingerprint import IMPACT_NAMES, show_value
    from specdecode.bench.store import ResultsStore, load_run

    store = ResultsStore(args.store)
    cmp = compare_runs(load_run(args.a, store), load_run(args.b, store))
    if args.json:
        print(json.dumps(cmp.to_dict(), indent=1))
        return 0
    out = Console(width=160, highlight=False)
    for i, line in enumerate(cmp.headline()):
        out.print(line, style="bold red" if i == 0 and cmp.changed else None, markup=False, soft_wrap=True)
    table = Table(title=f"speed: A = {cmp.a.run_id}  ->  B = {cmp.b.run_id}")
    for col in ("method", "A tok/s", "B tok/s", "B/A (95% CI)", "p", "test", "accept len A -> B", "same output",
                "verdict"):
        table.add_column(col, justify="left" if col in ("method", "test", "verdict") else "right")
    for m in cmp.methods:
        acc = (f"{m.accept_length_a:.2f} -> {m.accept_length_b:.2f}"
               if m.accept_length_a is not None and m.accept_length_b is not None else "-")
        table.add_row(m.method, f"{m.tok_per_s_a:.1f}", f"{m.tok_per_s_b:.1f}",
                      f"{m.ratio:.3f}x ({m.ci95[0]:.2f}-{m.ci95[1]:.2f})", f"{m.p_value:.3g}",
                      f"{'paired' if m.paired else 'unpaired'} n={m.n_a}/{m.n_b}", acc, m.same_output or "-",
                      m.verdict)
    out.print(table)
    env = Table(title="environment differences, most likely to matter first")
    for col in ("impact", "what", "A", "B", "why it matters"):
        env.add_column(col)
    for d in cmp.differences:
        env.add_row(IMPACT_NAMES[d.impact], d.label, _clip(show_value(d.before)), _clip(show_value(d.after)), d.why)
    out.print(env if cmp.differences else "environments identical")
    return 0
