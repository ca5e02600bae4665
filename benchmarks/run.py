"""The benchmark runner: a suite (benchmarks/suites/NAME.json) is data; this runs it and files the results.

    python benchmarks/run.py engine               # run suites/engine.json into results/<date>-engine/
    python benchmarks/run.py engine --dry-run     # print the commands only
    python benchmarks/run.py --index              # rewrite benchmarks/README.md, the index of result folders
    python benchmarks/run.py --check              # fail if the index is stale or a suite does not parse

A suite: {"question": ..., "steps": [{"name": ..., "run": [specdecode args], "out": true, "requires": module,
"serve": [specdecode serve args], "after_build": true, "may_fail": true}]}. Placeholders: {spec_bench}
($SPEC_BENCH: Spec-Bench's question.jsonl), {passages} ($PASSAGES), {copy_edit} (written from $CRUXEVAL:
``copy_edit_prompts``), {threads} ($THREADS, 2), {out} (the result folder), {port} (a free port). "out" adds
`--out {out}/raw/NAME.json`; "requires" skips the step where a Python module (or a placeholder's file, e.g.
"{vllm_python}": $VLLM_PYTHON, vLLM's interpreter from scripts/setup_vllm.sh) is missing; "serve" starts that server
first and stops it after; "after_build" waits first while compiled graphs are being built (a server's background
build); "may_fail" records an exit code of 1 (a check that failed) and goes on. Steps run one after another: never
two benchmarks at once. A result folder keeps its README and results.json (every step's JSON under its name); raw/
(stdout, server logs) is not tracked.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = ROOT / "benchmarks" / "suites"
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "benchmarks" / "README.md"
SHARED = ROOT.parent / "shared" / "data"  # the project's shared data folder, where it exists
DEFAULTS = {"spec_bench": str(SHARED / "spec_bench_questions.jsonl"),
            "passages": str(SHARED / "prompts" / "long" / "pubmedqa__pubmedqa.jsonl"),
            "cruxeval": str(SHARED / "prompts" / "facebookresearch__cruxeval.jsonl"), "threads": "2",
            "vllm_python": str(ROOT / ".venv-vllm" / "bin" / "python")}  # scripts/setup_vllm.sh
# {copy_edit}: requests whose answer copies most of the prompt (a function handed back renamed), written into
# the result folder from CRUXEval's functions (code none of us wrote): what --ngram's drafts from the text are for
COPY_EDIT = ("Rewrite this Python function with a descriptive function name and descriptive parameter names. "
             "Keep the body as it is. Return the whole function in one code block.\n\n```python\n{code}\n```")


def copy_edit_prompts(source: Path, dest: Path, n: int = 8, min_lines: int = 6) -> Path:
    """The first ``n`` functions of ``source`` (CRUXEval prompts) of at least ``min_lines`` lines, as copy-edit
    requests (``COPY_EDIT``), one {"prompt": ...} a line."""
    out = []
    for line in source.read_text().splitlines():
        m = re.search(r"```python\n(.*?)\n```", json.loads(line)["prompt"], re.S)
        if m and m.group(1).count("\n") + 1 >= min_lines:
            out.append(json.dumps({"prompt": COPY_EDIT.format(code=m.group(1))}))
        if len(out) == n:
            break
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(out) + "\n")
    return dest


def load_suite(name: str) -> dict:
    path = Path(name) if name.endswith(".json") else SUITES / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES.glob("*.json")))
        raise SystemExit(f"run.py: no suite {name!r} (suites: {known})")
    suite = json.loads(path.read_text())
    suite["name"] = path.stem
    for step in suite["steps"]:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", step["name"]):
            raise SystemExit(f"run.py: {path.name}: step name {step['name']!r}: use a-z, 0-9, '-', '_', '.'")
    return suite


def values(out: Path, port: int = 0) -> dict[str, str]:
    return {key: os.environ.get(key.upper(), default) for key, default in DEFAULTS.items()} | {
        "out": str(out), "port": str(port), "copy_edit": str(out / "raw" / "copy-edit-prompts.jsonl")}


def command(step: dict, key: str, fill: dict[str, str]) -> list[str]:
    args = [arg.format(**fill) for arg in step[key]]
    if key == "run" and step.get("out"):
        args += ["--out", f"{fill['out']}/raw/{step['name']}.json"]
    return [sys.executable, "-m", "specdecode", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"run.py: the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"run.py: the server was not ready after {timeout_s:.0f} s")


def wait_for_build(timeout_s: float = 3600) -> None:
    """Until no process builds compiled graphs into this machine's store (a server's background build)."""
    from specdecode.runtime.background import running_build

    t0 = time.monotonic()
    while (pid := running_build()) is not None:
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"run.py: a graph build (pid {pid}) still runs after {timeout_s:.0f} s")
        time.sleep(5)
    print(f"# waited {time.monotonic() - t0:.0f} s for graph builds to end", file=sys.stderr)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def machine(threads: str) -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") if Path("/proc/cpuinfo").exists() else open(os.devnull) as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} logical cores, {threads} threads, {platform.system()} {platform.release()}"


def run_suite(suite: dict, dry_run: bool) -> Path:
    out = RESULTS / f"{datetime.date.today().isoformat()}-{suite['name']}"
    n = 1
    while not dry_run and (out.parent / f"{out.name}{'' if n == 1 else f'-{n}'}" / "README.md").exists():
        n += 1  # a second run the same day gets its own folder, never the first one's
    out = out.parent / f"{out.name}{'' if n == 1 else f'-{n}'}"
    fill = values(out)
    used = {k for k in ("spec_bench", "passages", "cruxeval", "copy_edit")
            if any(f"{{{k}}}" in a for s in suite["steps"] for a in s["run"])}
    missing = [k for k in ("spec_bench", "passages", "cruxeval")
               if (k in used or (k == "cruxeval" and "copy_edit" in used)) and not Path(fill[k]).exists()]
    if missing and not dry_run:
        raise SystemExit(f"run.py: {', '.join(missing)} not found ({', '.join(fill[k] for k in missing)}): set "
                         + " and ".join(f"${k.upper()}" for k in missing) + " (SPEC_BENCH: Spec-Bench's "
                         "question.jsonl, github.com/hemingkx/Spec-Bench, data/spec_bench/)")
    ran: list[tuple[str, str]] = []
    raw = out / "raw"
    if not dry_run:
        raw.mkdir(parents=True, exist_ok=True)
    for step in suite["steps"]:
        port = free_port() if step.get("serve") else 0
        fill = values(out, port)
        need = step.get("requires")
        if need and (not Path(need.format(**fill)).is_file() if need.startswith("{")
                     else importlib.util.find_spec(need) is None):
            print(f"# {step['name']}: skipped, no {need.format(**fill)}", file=sys.stderr)
            continue
        if not dry_run and any("{copy_edit}" in a for a in step["run"]):
            copy_edit_prompts(Path(fill["cruxeval"]), Path(fill["copy_edit"]))
        cmd = command(step, "run", fill)
        shown = shlex.join(["specdecode", *cmd[3:]])
        if step.get("serve"):
            shown = f"specdecode {shlex.join(command(step, 'serve', fill)[3:])} &  # then:\n{shown}"
        print(shown)
        if dry_run:
            continue
        if step.get("after_build"):
            wait_for_build()
        server = None
        if step.get("serve"):
            log = open(raw / f"{step['name']}-server.log", "w")  # noqa: SIM115 (closed below)
            server = subprocess.Popen(command(step, "serve", fill), stdout=log, stderr=subprocess.STDOUT)
            wait_healthy(port, server)
        try:
            # vLLM's interpreter for the `vllm` bench method, so that method names carry no path
            env = os.environ | {"COLUMNS": "200"} | (
                {"SPECDECODE_VLLM_PYTHON": fill["vllm_python"]} if Path(fill["vllm_python"]).is_file() else {})
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        finally:
            if server is not None:
                server.terminate()
                server.wait(60)
                log.close()
        (raw / f"{step['name']}.txt").write_text(f"$ {shown}\n{proc.stdout}{proc.stderr}")
        if proc.returncode and not (step.get("may_fail") and proc.returncode == 1):
            raise SystemExit(f"run.py: step {step['name']} failed ({proc.returncode}); see {raw / step['name']}.txt")
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        failed = f"\n(exit {proc.returncode}: {last})" if proc.returncode else ""
        ran.append((shown, proc.stdout.strip() + failed))
    if not dry_run:
        files = {p.name: json.loads(p.read_text()) for p in sorted(raw.glob("*.json"))}
        (out / "results.json").write_text(json.dumps({"about": f"Every step's JSON of suite {suite['name']}, under "
                                                               "its file name; the README has the commands.",
                                                      "files": files}, indent=1) + "\n")
        write_readme(suite, out, ran, fill["threads"])
        print(f"results: {out.relative_to(ROOT)} (write its verdict in README.md, then: python benchmarks/run.py "
              f"--index)", file=sys.stderr)
    return out


def write_readme(suite: dict, out: Path, ran: list[tuple[str, str]], threads: str) -> None:
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    text = [f"# {suite['name']}: {suite['question']}", "",
            f"- Suite: `benchmarks/suites/{suite['name']}.json`, run by `python benchmarks/run.py {suite['name']}`",
            f"- Commit: {git('rev-parse', '--short', 'HEAD')}{dirty}; date: {datetime.date.today().isoformat()}",
            f"- Machine: {machine(threads)}", "", "## Commands and summaries", ""]
    for shown, stdout in ran:
        lines = stdout.splitlines()  # the overall table comes first (bench: then per category); raw/ has all
        text += ["```", f"$ {shown}", *lines[:45], *(["... (the rest in raw/, untracked)"] if len(lines) > 45 else []),
                 "```", ""]
    text += ["## Verdict", "", f"{UNWRITTEN}: what the figures answer.", ""]
    (out / "README.md").write_text("\n".join(text))


UNWRITTEN = "To be written by whoever ran it"  # run.py --check fails while a folder's verdict says this


def folder_entry(folder: Path) -> tuple[str, str]:
    """(question, verdict) from a result folder's README: its first heading, and the first paragraph under
    '## Verdict' (or a line starting 'Verdict:')."""
    readme = folder / "README.md"
    if not readme.exists():
        return "(no README)", ""
    lines = readme.read_text().splitlines()
    question = next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), "(no heading)")
    verdict = ""
    for i, line in enumerate(lines):
        heading = line.strip().lower() in ("## verdict", "## verdicts")
        if heading or line.lower().startswith(("verdict:", "**verdict")):
            para = [] if heading else [line.split(":", 1)[-1].strip(" *")]
            for nxt in lines[i + 1:]:
                if nxt.startswith("#") or (not nxt.strip() and para):
                    break
                if nxt.strip():
                    para.append(nxt.strip())
            verdict = " ".join(para)
            break
    if len(verdict) > 300:  # the index is a table: the folder's README has the rest
        verdict = verdict[:297].rsplit(" ", 1)[0] + " ..."
    return question.replace("|", "/"), verdict.replace("|", "/")


def render_index() -> str:
    rows = ["# Benchmarks", "",
            "Suites (`suites/*.json`) are data; `python benchmarks/run.py SUITE` runs one, one step at a time, into",
            "`results/<date>-SUITE/` with a README (question, commands, commit, machine, then the verdict its runner",
            "writes). `tools/` holds the measurements that are no `specdecode` command (kernels alone, a load test).",
            "This index is generated (`python benchmarks/run.py --index`; the tests fail when it is stale).", "",
            "## Suites", "", "| suite | question |", "|---|---|"]
    for path in sorted(SUITES.glob("*.json")):
        rows.append(f"| [{path.stem}](suites/{path.name}) | {json.loads(path.read_text())['question']} |")
    rows += ["", "## Result folders", "", "| folder | question | verdict |", "|---|---|---|"]
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        question, verdict = folder_entry(folder)
        rows.append(f"| [{folder.name}](results/{folder.name}/) | {question} | {verdict} |")
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    if loose:
        rows += ["", "Loose result files (from before result folders): " + ", ".join(f"`{n}`" for n in loose) + "."]
    return "\n".join(rows) + "\n"


FILE_BUDGET = 150  # files under benchmarks/: a result folder keeps its README and a summary, not raw runs
RAW = (".log", ".png", ".patch", ".pt", ".db")  # raw output stays out of the tree


def budget() -> list[str]:
    files = [p for p in ROOT.joinpath("benchmarks").rglob("*")
             if p.is_file() and not {"__pycache__", "raw"} & set(p.parts)]
    problems = []
    if len(files) > FILE_BUDGET:
        problems.append(f"benchmarks/ holds {len(files)} files (budget {FILE_BUDGET}): merge a result folder's "
                        "measurement files into its results.json and drop raw runs (they stay in git history)")
    problems += [f"{p.relative_to(ROOT)}: raw output ({p.suffix}) does not belong in the tree; keep the figures in "
                 "the folder's README or results.json" for p in files if p.suffix in RAW and RESULTS in p.parents]
    return problems


def check() -> int:
    from specdecode.cli.main import build_parser

    problems = []
    for path in sorted(SUITES.glob("*.json")):
        suite = load_suite(str(path))
        for step in suite["steps"]:
            for key in ("run", "serve"):
                if key in step:
                    # prompt files must exist to parse: this file stands in for them
                    fill = values(Path("OUT"), 8000) | dict.fromkeys(("spec_bench", "passages", "copy_edit"), __file__)
                    args = command(step, key, fill)[3:]
                    try:
                        build_parser(args[:1]).parse_args(args)
                    except SystemExit:
                        problems.append(f"{path.name}: step {step['name']}: `specdecode {shlex.join(args)}` "
                                        f"does not parse")
    problems += budget()
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        verdict = folder_entry(folder)[1]
        if not verdict or verdict.startswith(UNWRITTEN):
            problems.append(f"{folder.relative_to(ROOT)}/README.md has no verdict: write what the figures answer "
                            "under '## Verdict'")
    if INDEX.read_text() != render_index():
        problems.append("benchmarks/README.md is stale: python benchmarks/run.py --index")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", help="a suite name (benchmarks/suites/NAME.json) or a suite file")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--index", action="store_true", help="rewrite benchmarks/README.md")
    parser.add_argument("--check", action="store_true", help="suites parse and the index is fresh")
    args = parser.parse_args()
    if args.check:
        return check()
    if args.index:
        INDEX.write_text(render_index())
        return 0
    if not args.suite:
        parser.error("name a suite, or give --index or --check")
    run_suite(load_suite(args.suite), args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
