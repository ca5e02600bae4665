"""The prose a newcomer reads first keeps its promises: the README is short, starts with a command, lists
every command, points only inside the repository, and its results table is generated from the result files;
ARCHITECTURE.md names the modules that exist, and every module is named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from specdecode.cli.commands import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_starts_with_a_command():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    first = next(i for i, line in enumerate(lines) if re.match(r"(scripts/demo\.sh|\.venv/bin/specdecode|specdecode) ",
                                                                   line))
    assert first < 40, first


def test_the_readme_lists_every_command_and_links_inside_the_repository():
    listed = re.findall(r"^\| `([a-z-]+)` \|", README, flags=re.MULTILINE)
    assert sorted(listed) == sorted(SUBCOMMANDS), listed
    assert "../" not in README  # no path outside the repository
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), (doc.name, target)


def test_the_readme_results_table_is_generated_from_the_result_files():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_results.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_readme_table_takes_the_newest_run_of_each_suite_and_names_the_machine(tmp_path):
    """Picked by rule, not by hand: a newer run of a cited suite changes the table (so --check fails until it is
    regenerated); every row group says which machine measured it and whether the steps ran compiled."""
    import json
    import runpy
    import shutil

    script = runpy.run_path(str(ROOT / "scripts" / "readme_results.py"))
    spec = json.loads((ROOT / "benchmarks" / "readme-results.json").read_text())
    results = tmp_path / "results"
    results.mkdir()
    for row in spec["rows"]:
        src = script["newest_run"](row["suite"])
        shutil.copytree(src, results / src.name)
    script["render"].__globals__["ROOT"] = tmp_path
    shown = script["render"](results=results)
    header = shown.splitlines()[0]
    assert "| machine |" in header and "| steps |" in header
    suite = spec["rows"][0]["suite"]
    newer = results / f"2999-01-01-{suite}"
    shutil.copytree(script["newest_run"](suite, results), newer)
    data = json.loads((newer / "results.json").read_text())
    step = data["files"][f"{spec['rows'][0]['step']}.json"]
    step["fingerprint"]["cpu"]["model"] = "Another CPU"
    (newer / "results.json").write_text(json.dumps(data))
    assert script["newest_run"](suite, results) == newer
    (results / f"2999-01-01-{suite}-2").mkdir()  # a same-day run without its results yet: not a run
    assert script["newest_run"](suite, results) == newer
    again = script["render"](results=results)
    assert again != shown and "Another CPU" in again and f"2999-01-01-{suite}" in again


def test_architecture_names_every_module_and_only_modules_that_exist():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert not re.search(r"about \d+ lines", text)  # line counts go stale
    for package in ("core", "io", "runtime", "bench", "training", "serving", "integrations", "cli"):
        start = text.index(f"**`{package}/`**")
        end = text.find("\n**`", start + 1)
        paragraph = text[start:end if end > 0 else None]
        named = set(re.findall(r"`([a-z_]+)\.py`", paragraph))
        if package == "cli":  # one module per command, named in the command table
            named |= {module for module, _ in SUBCOMMANDS.values()}
        modules = {p.stem for p in (ROOT / "specdecode" / package).glob("*.py")} - {"__init__", "__main__"}
        assert named <= modules, (package, named - modules)
        assert modules <= named, (package, modules - named)


def test_the_cycle_diagram_names_functions_that_exist():
    from specdecode.core import speculative

    text = (ROOT / "ARCHITECTURE.md").read_text()
    diagram = text[text.index("## Data flow of one speculative cycle"):text.index("## Long modules")]
    named = set(re.findall(r"\b([a-z]+_[a-z_]+|spec_cycle)\b", diagram)) - {"num_steps", "num_draft_tokens"}
    missing = [n for n in named if not hasattr(speculative, n)]
    assert not missing, missing
    for cls in re.findall(r"\b(DraftState|DraftTree|Verification|Acceptance|SpecRow|CycleResult)\b", diagram):
        assert hasattr(speculative, cls), cls


def test_module_docstrings_stay_short():
    """What and why in a few lines; measurements and reference go to docs/ and result folders."""
    import ast

    long = []
    for path in (ROOT / "specdecode").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 15:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long, long


def test_benchmark_suites_parse_and_the_index_is_fresh():
    """Suites are data checked against the CLI they call; benchmarks/README.md indexes every result folder."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    top = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert top == ["run.py"], top  # the runner; the rest are suites, tools/ or archive/


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",") for p in _expand(path[:match.start()] + alt + path[match.end():])]


def test_every_cited_result_path_exists():
    """Prose cites result folders (or files in them); a folder that is pruned or renamed must not leave a dangling
    citation behind."""
    texts = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "scripts").glob("*.py"), *(ROOT / "specdecode").rglob("*.py"),
             *(ROOT / "specdecode").rglob("*.md")]
    missing = []
    for path in texts:
        for cited in re.findall(r"benchmarks/results/[A-Za-z0-9_.,{}*+/-]+", path.read_text()):
            for one in _expand(cited.rstrip(".,:;")):
                if not list(ROOT.glob(one.rstrip("/"))):
                    missing.append(f"{path.relative_to(ROOT)}: {one}")
    assert not missing, missing


def test_the_benchmark_file_budget_fails_when_exceeded():
    import runpy

    run = runpy.run_path(str(ROOT / "benchmarks" / "run.py"))
    assert run["budget"]() == []
    run["budget"].__globals__["FILE_BUDGET"] = 10
    assert any("budget 10" in problem for problem in run["budget"]())


def test_every_benchmark_tool_starts():
    """Nothing else runs the scripts under benchmarks/tools/: each must at least import and parse its flags
    (`compiled_steps.py` had crashed unnoticed since the runner stopped being callable)."""
    tools = sorted((ROOT / "benchmarks" / "tools").glob("*.py"))
    assert tools
    for tool in tools:
        proc = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (tool.name, proc.stderr[-2000:])
