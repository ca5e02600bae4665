"""`specdecode tune`: search a grid of environment variables, one fresh process per point.

Thread pools and NCCL read their variables at start-up, so each point runs
``specdecode bench ARGS`` in a new process with the point's environment. Points run in
rounds whose order rotates, so drift on a shared machine does not always favour the same
point; each point's score is the median over rounds of the chosen method's median tok/s.
The winner can be saved as a launch profile for ``--launch-profile NAME``.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench.profiles import LaunchProfile
from specdecode.bench.store import Run, new_run_id, now

UNSET = "unset"  # a grid value meaning: the variable is absent


def parse_env_grid(items: list[str]) -> list[tuple[str, list[str | None]]]:
    """``["OMP_NUM_THREADS=1,2", "NCCL_PROTO=LL,unset"]`` -> axes of (name, values); None = unset."""
    axes: list[tuple[str, list[str | None]]] = []
    for item in items:
        name, eq, values = item.partition("=")
        name = name.strip()
        if not eq or not name or not values.strip():
            raise ValueError(f"--env {item!r}: expected NAME=VALUE1,VALUE2,... (use 'unset' for an absent variable)")
        if not name.replace("_", "").isalnum():
            raise ValueError(f"--env {item!r}: {name!r} is not an environment variable name")
        if name in (n for n, _ in axes):
            raise ValueError(f"--env names {name} twice; give all its values in one --env")
        axes.append((name, [None if v.strip() == UNSET else v.strip() for v in values.split(",")]))
    return axes


def grid_points(axes: list[tuple[str, list[str | None]]]) -> list[dict[str, str | None]]:
    names = [n for n, _ in axes]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))]


def point_label(point: dict[str, str | None]) -> str:
    return " ".join(f"{k}={UNSET if v is None else v}" for k, v in point.items()) or "(inherited environment)"


def point_env(point: dict[str, str | None], base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    for k, v in point.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


COMMANDS = ("bench", "comm-bench")


def child_command(command: str, bench_args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "specdecode", command, *bench_args, "--out", str(out), "--no-store"]


def run_point(command: str, point: dict, bench_args: list[str], timeout_s: float) -> dict:
    """Run the command once in a fresh process with the point's environment; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run(child_command(command, bench_args, out), env=point_env(point, os.environ),
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ValueError(f"{command} failed at {point_label(point)} (exit {proc.returncode}): "
                             + " | ".join(tail))
        return json.loads(out.read_text())


def score(result: dict, method: str | None) -> tuple[str, float]:
    """(what is scored, value; higher is better): a command's own score (comm-bench: bus
    bandwidth) or a benchmarked method's median tok/s."""
    if "score" in result:
        return result["score"]["name"], result["score"]["value"]
    rows = result["summary"]
    row = rows[0] if method is None else next((r for r in rows if r["method"] == method), None)
    if row is None:
        raise ValueError(f"--method {method!r} is not among the benchmarked methods "
                         f"({', '.join(r['method'] for r in rows)})")
    return row["method"], row["tok_per_s_median"]


@dataclass(frozen=True)
class TuneConfig:
    env: tuple[str, ...]  # axes, "NAME=V1,V2" ("unset": the variable absent)
    command: str = "bench"  # what each point runs: one of COMMANDS
    rounds: int = 2  # passes over the grid, order rotated
    method: str | None = None  # the benchmarked method whose median tok/s is the score (None: the first)
    timeout_s: float = 1800  # per point
    command_args: tuple[str, ...] = ()  # the command's own arguments


def plan(config: TuneConfig) -> list[dict[str, str | None]]:
    """The grid's points, after checking the configuration."""
    if any(a in ("--out", "--launch-profile") or a.startswith(("--out=", "--launch-profile="))
           for a in config.command_args):
        raise ValueError("tune sets --out itself and tunes the environment: drop --out/--launch-profile "
                         "from the command's arguments")
    if not config.env:
        raise ValueError("give at least one --env NAME=V1,V2 axis to search")
    if config.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {config.rounds}")
    return grid_points(parse_env_grid(list(config.env)))


@dataclass
class TuneResult:
    config: TuneConfig
    points: list[dict[str, str | None]]
    scores: dict[int, list[float]]  # point index -> score per round
    method: str | None  # what was scored
    children: list[dict]  # one record per point and round
    elapsed_s: float

    @property
    def medians(self) -> dict[int, float]:
        return {i: statistics.median(v) for i, v in self.scores.items()}

    @property
    def best(self) -> int:
        medians = self.medians
        return max(medians, key=lambda i: medians[i])

    def summary(self) -> list[dict]:
        medians = self.medians
        return [{"method": point_label(self.points[i]), "point": self.points[i], "score_name": self.method,
                 "score_median": medians[i], "score_rounds": self.scores[i]}
                | ({"tok_per_s_median": medians[i]} if self.config.command == "bench" else {})
                for i in range(len(self.points))]

    def to_run(self) -> Run:
        fingerprint: dict = next((c["fingerprint"] for c in self.children if c["fingerprint"]), {})
        return Run(new_run_id(), "tune", now(), fingerprint, self.summary(), self.children,
                   {"bench_args": list(self.config.command_args), "best": point_label(self.points[self.best]),
                    "method": self.method})

    def profile(self, name: str) -> LaunchProfile:
        """The best point as a launch profile."""
        best, c = self.best, self.config
        median = self.medians[best]
        return LaunchProfile(
            name, {k: "" if v is None else v for k, v in self.points[best].items()},
            f"tuned by specdecode tune --command {c.command}: {self.method} {median:.4g} (median over "
            f"{c.rounds} rounds), best of {len(self.points)} points; args: {shlex.join(c.command_args)}",
            extra={"score": round(median, 4)})


def tune(config: TuneConfig, on_point: Callable[[int, dict], None] | None = None,
         on_score: Callable[[str, float], None] | None = None) -> TuneResult:
    """Run every point ``config.rounds`` times, the order rotated per round. ``on_point(round,
    point)`` is called before a point runs, ``on_score(what, value)`` after."""
    points = plan(config)
    scores: dict[int, list[float]] = {i: [] for i in range(len(points))}
    children: list[dict] = []
    method = config.method
    t0 = time.perf_counter()
    for rnd in range(config.rounds):
        order = list(range(len(points)))
        k = rnd % len(points)
        for i in order[k:] + order[:k]:
            if on_point:
                on_point(rnd, points[i])
            result = run_point(config.command, points[i], list(config.command_args), config.timeout_s)
            method, value = score(result, method)
            scores[i].append(value)
            children.append({"method": point_label(points[i]), "run": rnd, "prompt_id": "grid",
                             "category": "tune", "tok_per_s": value, "point": points[i],
                             "fingerprint": result.get("fingerprint")})
            if on_score:
                on_score(method, value)
    return TuneResult(config, points, scores, method, children, time.perf_counter() - t0)
