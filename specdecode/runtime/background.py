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

BUILD_LOCK = ".build.lock"  # in the graph store: held by the one process building into it
BACKGROUND_ENV = "SPECDECODE_BACKGROUND_COMPILE"  # 0: a run never starts a build in the background


@contextlib.contextmanager
def build_lock(root: Path, wait: bool = True) -> Iterator[bool]:
    """One building process per graph store (``specdecode compile``, in the foreground or the
    background): yields True while this process holds the lock; False at once, holding nothing, when
    another process holds it and ``wait`` is False. The lock goes with the process, however it ends."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / BUILD_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def building(root: Path) -> bool:
    """Whether another process is building into the store at ``root`` now."""
    with build_lock(root, wait=False) as mine:
        return not mine


@dataclass(frozen=True)
class BackgroundBuild:
    pid: int | None  # None: not started (``why``)
    why: str
    log: Path | None = None


def build_in_background(compile_args: list[str], root: Path) -> BackgroundBuild:
    """Start ``specdecode compile COMPILE_ARGS --if-idle`` detached from this process (its own session:
    it outlives the run that started it; output in ``root/build.log``), unless $SPECDECODE_BACKGROUND_COMPILE
    is 0 or a build is running. Its graphs land whole (``PackageStore.build``), so a run that starts
    meanwhile loads what is there and runs the rest eager."""
    if os.environ.get(BACKGROUND_ENV, "1") == "0":
        return BackgroundBuild(None, f"${BACKGROUND_ENV}=0")
    if building(root):
        return BackgroundBuild(None, f"another process is building into {root}")
    log = root / "build.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "compile", *compile_args, "--if-idle"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return BackgroundBuild(proc.pid, "started", log)
