"""Launch profiles: a named set of environment variables applied before any library starts.

Thread pools (OpenMP, MKL, OpenBLAS) and NCCL read their variables once, at start-up, so a
profile cannot be applied from inside a running process: ``--launch-profile NAME`` makes
the CLI re-execute itself with the profile's environment before importing torch. The
profile is recorded in every result's fingerprint, and a live environment that contradicts
it (a variable changed after the fact, a ``--threads`` that overrides the profile's thread
count) is flagged there and printed.

A profile is a small TOML file in ``$SPECDECODE_PROFILE_DIR`` (default
``~/.config/specdecode/profiles``) or any path ending in ``.toml``::

More in docs/measuring.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

APPLIED_ENV = "SPECDECODE_LAUNCH_PROFILE"  # set in the re-executed process: the profile applied
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class LaunchProfile:
    name: str
    env: dict[str, str]  # "" = unset
    description: str = ""
    created: str = ""
    path: Path | None = None
    extra: dict = field(default_factory=dict)  # e.g. what tune measured

    def to_toml(self) -> str:
        # JSON string escapes are valid TOML basic-string escapes for what we write
        lines = [f"name = {json.dumps(self.name)}", f"description = {json.dumps(self.description)}",
                 f"created = {json.dumps(self.created or time.strftime('%Y-%m-%d %H:%M:%S'))}"]
        for key, value in self.extra.items():
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
        lines.append("[env]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in sorted(self.env.items())]
        return "\n".join(lines) + "\n"

    def apply_to(self, environ: Mapping[str, str]) -> dict[str, str]:
        out = dict(environ)
        for k, v in self.env.items():
            if v == "":
                out.pop(k, None)
            else:
                out[k] = v
        return out

    def contradictions(self, environ: Mapping[str, str] | None = None, threads: int | None = None) -> list[str]:
        """How the live environment departs from the profile (empty: it does not)."""
        environ = os.environ if environ is None else environ
        out = []
        for k, v in sorted(self.env.items()):
            live = environ.get(k)
            if (v == "" and live is not None) or (v != "" and live != v):
                out.append(f"{k}: profile {v or '(unset)'}, live {live if live is not None else '(unset)'}")
        omp = self.env.get("OMP_NUM_THREADS", "").split(",")[0]
        if threads is not None and omp.isdigit() and int(omp) != threads:
            out.append(f"torch threads: profile OMP_NUM_THREADS={omp}, live {threads} (--threads or "
                       f"SPECDECODE_THREADS overrides it)")
        return out

    def record(self, threads: int | None = None) -> dict:
        """What the fingerprint stores about the profile."""
        return {"name": self.name, "path": str(self.path) if self.path else None, "env": self.env,
                "applied": os.environ.get(APPLIED_ENV) == self.name,
                "contradictions": self.contradictions(threads=threads)}


def profile_dir() -> Path:
    env = os.environ.get("SPECDECODE_PROFILE_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "specdecode" / "profiles"


def profile_path(ref: str) -> Path:
    if ref.endswith(".toml") or "/" in ref:
        return Path(ref)
    if not NAME_RE.match(ref):
        raise ValueError(f"launch profile name {ref!r}: use letters, digits, '.', '_' or '-'")
    return profile_dir() / f"{ref}.toml"


def load_profile(ref: str) -> LaunchProfile:
    import tomllib

    path = profile_path(ref)
    if not path.is_file():
        known = sorted(p.stem for p in profile_dir().glob("*.toml")) if profile_dir().is_dir() else []
        raise ValueError(f"launch profile {ref!r} not found at {path}; known profiles: "
                         f"{', '.join(known) or '(none)'} (create one with `specdecode tune ... --save-profile NAME`)")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"launch profile {path} is not valid TOML: {e}") from None
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float)) for v in env.values()):
        raise ValueError(f"launch profile {path}: [env] must map variable names to strings")
    extra = {k: v for k, v in data.items() if k not in ("name", "description", "created", "env")}
    return LaunchProfile(str(data.get("name") or path.stem), {k: str(v) for k, v in env.items()},
                         str(data.get("description", "")), str(data.get("created", "")), path, extra)


def save_profile(profile: LaunchProfile, ref: str | None = None) -> Path:
    path = profile_path(ref or profile.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(profile.to_toml())
    tmp.replace(path)  # never a half-written profile
    return path


def launch_profile_arg(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--launch-profile" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--launch-profile="):
            return a.split("=", 1)[1]
    return None


def reexec_with_profile(argv: list[str]) -> None:
    """If argv names a launch profile not yet applied, replace this process by one started
    with the profile's environment (thread pools and NCCL read it at start-up). Returns
    when there is nothing to do."""
    ref = launch_profile_arg(argv)
    if ref is None:
        return
    profile = load_profile(ref)
    if os.environ.get(APPLIED_ENV) == profile.name:
        return  # already the re-executed process
    env = profile.apply_to(os.environ) | {APPLIED_ENV: profile.name}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "specdecode", *argv], env)
