"""Building graphs in the background: one building process per graph store (a file lock), and the
detached ``specdecode compile --if-idle`` a ``generate`` run starts after it ran some shape eager
(``cli.generate``). More in docs/compiled.md."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdecode.io.paths import cache_root

BUILD_LOCK = ".build.lock"  # in the graph store: held by the one process building into it
BACKGROUND_ENV = "SPECDECODE_BACKGROUND_COMPILE"  # 0: a run never starts a build in the background


@contextlib.contextmanager
def build_lock(root: Path, wait: bool = True) -> Iterator[bool]:
    """One building process per graph store (``specdecode compile``, in the foreground or the
    background): yields True while this process holds the lock; False at once, holding nothing, when
    another process holds it and ``wait`` is False. The lock goes with the process, however it ends."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / BUILD_LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            f.truncate(0)
            f.write(f"{os.getpid()}\n")  # who builds: named by ``running_build``
            f.flush()
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def building(root: Path) -> bool:
    """Whether another process is building into the store at ``root`` now."""
    with build_lock(root, wait=False) as mine:
        return not mine


def running_build(root: Path | None = None) -> int | None:
    """The pid of a process building graphs into the store at ``root`` (default: this cache's) now, else None
    (0: one is, its pid unknown). What ``bench``, ``sweep`` and ``tune`` warn of, and a fingerprint records: the
    build takes the cores it is given for minutes."""
    if root is None:
        root = cache_root() / "graphs"
    lock = root / BUILD_LOCK
    if not lock.is_file():
        return None
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def lowest_priority() -> None:
    """In a child before it runs (``Popen(preexec_fn=...)``): the idle scheduling class, inherited by every thread
    and compiler process it starts, so that it runs on cores nothing else wants (a decode, a benchmark) and yields
    them at once when something does."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:  # not Linux
        os.nice(19)


@dataclass(frozen=True)
class BackgroundBuild:
    pid: int | None  # None: not started (``why``)
    why: str
    log: Path | None = None


def build_in_background(compile_args: list[str], root: Path) -> BackgroundBuild:
    """Start ``specdecode compile COMPILE_ARGS --if-idle`` detached from this process (its own session:
    it outlives the run that started it; output in ``root/build.log``) at the lowest priority
    (``lowest_priority``), unless $SPECDECODE_BACKGROUND_COMPILE is 0 or a build is running. Its graphs land
    whole (``PackageStore.build``), so a run that starts meanwhile loads what is there and runs the rest eager."""
    if os.environ.get(BACKGROUND_ENV, "1") == "0":
        return BackgroundBuild(None, f"${BACKGROUND_ENV}=0")
    if building(root):
        return BackgroundBuild(None, f"another process is building into {root}")
    log = root / "build.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "compile", *compile_args, "--if-idle"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lowest_priority)
    return BackgroundBuild(proc.pid, "started", log)


def build_warning(root: Path | None = None) -> str | None:
    """One line for a command that measures (``bench``, ``sweep``, ``tune``) started while graphs are being
    built (``running_build``), else None."""
    pid = running_build(root)
    if pid is None:
        return None
    root = root or cache_root() / "graphs"
    who = f"pid {pid}" if pid else "another process"
    kill = f", or kill {pid}" if pid else ""
    return (f"WARNING: compiled graphs are being built ({who}, its output: {root / 'build.log'}). It runs at the "
            "lowest priority but shares this machine's caches and memory bandwidth, and what it has not stored yet "
            f"runs eager here: for timings to trust, wait until it ends (`specdecode compile` waits for it){kill}")
