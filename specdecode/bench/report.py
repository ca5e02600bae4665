"""`specdecode report`: one Markdown or HTML page from stored runs: environment, tables, plots,
and (for two or more runs) what changed between them.

The page is built as a list of blocks (heading, text, table, image) rendered to either
format; HTML embeds the plots, so the file stands alone.
"""

from __future__ import annotations

import base64
import html
import time
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench.compare import compare_runs
from specdecode.bench.fingerprint import IMPACT_NAMES, show_value
from specdecode.bench.plots import speed_plot, sweep_plots
from specdecode.bench.store import Run


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Text:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: Path
    caption: str


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt) if isinstance(v, (int, float)) else str(v)


def environment_table(fp: dict) -> Table:
    cpu, gpu, prof = fp.get("cpu") or {}, fp.get("gpu") or {}, fp.get("launch_profile") or {}
    rows = [
        ["device / dtype / threads", f"{fp.get('device')} / {fp.get('dtype')} / {fp.get('threads')}"],
        ["CPU", f"{cpu.get('model')} ({cpu.get('affinity_count')} of {cpu.get('logical_cores')} cores; "
                f"load {cpu.get('loadavg_1m')}; governor {cpu.get('governor') or 'n/a'})"],
        ["GPU", ", ".join(gpu.get("devices") or []) or "none"],
        ["versions", ", ".join(f"{k} {v}" for k, v in (fp.get("versions") or {}).items())],
        ["project commit", str(fp.get("git_commit"))],
        ["model / drafter sha256",
         f"{(fp.get('model') or {}).get('sha256')} / {(fp.get('drafter') or {}).get('sha256')}"],
        ["launch profile", f"{prof.get('name')} (contradictions: {len(prof.get('contradictions', []))})"
         if prof else "none"],
        ["environment variables", ", ".join(f"{k}={v}" for k, v in (fp.get("env") or {}).items()) or "none"],
        ["command", " ".join(fp.get("argv") or [])],
    ]
    return Table(["what", "value"], rows)


SUMMARY_HEADER = ["method", "tok/s median", "min", "max", "ms/token", "TTFT ms", "speedup (95% CI)", "accept len",
                  "accept rate", "same output"]


def summary_rows(summary: list[dict]) -> list[list[str]]:
    rows = []
    for s in summary:
        ci = s.get("speedup_ci95") or [None, None]
        speed = _f(s.get("speedup"), ".2f") + "x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci[0] == ci[0] and ci[0] else "")
        rows.append([s["method"], _f(s.get("tok_per_s_median")), _f(s.get("tok_per_s_min")),
                     _f(s.get("tok_per_s_max")), _f(s.get("ms_per_token_median")), _f(s.get("ttft_ms_median"), ".0f"),
                     speed if "speedup" in s else "-", _f(s.get("accept_length"), ".2f"),
                     _f(s.get("accept_rate"), ".2f"), s.get("outputs_match_baseline", "-")])
    return rows


def run_blocks(run: Run, out_dir: Path) -> list:
    blocks: list = [Heading(f"{run.kind} run {run.run_id} ({run.created})"),
                    Text(f"model {run.meta.get('model', (run.fingerprint.get('model') or {}).get('path'))}, "
                         f"{run.meta.get('max_new_tokens', '?')} new tokens, {len(run.records)} records"),
                    Table(SUMMARY_HEADER, summary_rows(run.summary))]
    for category, summary in (run.meta.get("by_category") or {}).items():
        blocks += [Heading(f"category {category}", 4), Table(SUMMARY_HEADER, summary_rows(summary))]
    plot = speed_plot(run, out_dir)
    if plot:
        blocks.append(Image(plot, "median tok/s per method, bars from min to max"))
    if run.kind == "sweep" and run.meta.get("configs"):
        sweep_dir = out_dir / f"{run.run_id}-sweep"
        for p in sweep_plots(run.meta, sweep_dir):
            blocks.append(Image(p, p.stem.replace("_", " ")))
        blocks.append(Text(f"best configuration: {run.meta.get('best')}"))
    blocks += [Heading("environment", 4), environment_table(run.fingerprint)]
    return blocks


def comparison_blocks(a: Run, b: Run) -> list:
    cmp = compare_runs(a, b)
    rows = [[m.method, _f(m.tok_per_s_a), _f(m.tok_per_s_b), f"{m.ratio:.3f}x ({m.ci95[0]:.2f}-{m.ci95[1]:.2f})",
             f"{m.p_value:.3g}", m.verdict] for m in cmp.methods]
    env = [[IMPACT_NAMES[d.impact], d.label, show_value(d.before)[:60], show_value(d.after)[:60], d.why]
           for d in cmp.differences]
    return [Heading(f"{a.run_id} -> {b.run_id}", 3), Text("\n".join(cmp.headline())),
            Table(["method", "A tok/s", "B tok/s", "B/A (95% CI)", "p", "verdict"], rows),
            Table(["impact", "what", "A", "B", "why"], env) if env else Text("environments identical")]


def build(runs: list[Run], out_dir: Path) -> list:
    blocks: list = [Heading(f"specdecode report ({time.strftime('%Y-%m-%d %H:%M')})", 1),
                    Text(f"{len(runs)} run(s): " + ", ".join(r.run_id for r in runs))]
    if len(runs) > 1:
        blocks.append(Heading("what changed (first run against each other)"))
        for other in runs[1:]:
            blocks += comparison_blocks(runs[0], other)
    for run in runs:
        blocks += run_blocks(run, out_dir)
    return blocks


def to_markdown(blocks: list, out_dir: Path) -> str:
    lines = []
    for b in blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Text):
            lines += [b.text.replace("\n", "  \n"), ""]
        elif isinstance(b, Table):
            cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines += ["| " + " | ".join(map(cell, b.header)) + " |", "|" + "---|" * len(b.header)]
            lines += ["| " + " | ".join(map(cell, r)) + " |" for r in b.rows] + [""]
        elif isinstance(b, Image):
            lines += [f"![{b.caption}]({b.path.relative_to(out_dir).as_posix()})", ""]
    return "\n".join(lines)


def to_html(blocks: list) -> str:
    e = html.escape
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            body.append("<p>" + "<br>".join(map(e, b.text.splitlines())) + "</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{e(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b.rows)
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.path.read_bytes()).decode()
            body.append(f'<figure><img src="data:image/png;base64,{data}"><figcaption>{e(b.caption)}'
                        f"</figcaption></figure>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse;margin:8px 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}td{text-align:right}img{max-width:100%}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>specdecode report</title><style>{style}" \
           f"</style></head><body>{''.join(body)}</body></html>"


def write_report(runs: list[Run], out: Path) -> int:
    """Write the page for ``runs`` to ``out`` (``.md``: Markdown with PNGs in OUT-files/ beside it;
    ``.html``: one self-contained file); returns how many plots it holds."""
    if out.suffix not in (".md", ".html"):
        raise ValueError(f"--out {out}: use a .md or .html file name")
    assets = out.parent / f"{out.stem}-files"
    assets.mkdir(parents=True, exist_ok=True)
    blocks = build(runs, assets)
    out.write_text(to_html(blocks) if out.suffix == ".html" else to_markdown(blocks, out.parent))
    return sum(isinstance(b, Image) for b in blocks)
