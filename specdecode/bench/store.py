"""Results store: every measuring run (bench, sweep, tune) lands here with its fingerprint.

SQLite by default (``$SPECDECODE_RESULTS_DB`` or ``~/.local/share/specdecode/results.db``;
WAL mode and a busy timeout so concurrent writers wait instead of losing rows), and
optionally a JSON-lines file (one ``run`` line then one line per record, appended under an
exclusive lock). A run is referred to by its id, a unique prefix of it, ``latest``, or a
file (``results.jsonl``, ``results.jsonl#RUN_ID``, or a bench ``--out`` JSON).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import secrets
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    run_id: str
    kind: str  # "bench", "sweep", "tune", ...
    created: str
    fingerprint: dict
    summary: list[dict]
    records: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # anything else (by_category, max_new_tokens, ...)

    def header(self) -> dict:
        return {"type": "run", "run_id": self.run_id, "kind": self.kind, "created": self.created,
                "fingerprint": self.fingerprint, "summary": self.summary, "meta": self.meta}


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def default_db_path() -> Path:
    env = os.environ.get("SPECDECODE_RESULTS_DB")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "specdecode" / "results.db"


SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, kind TEXT NOT NULL, created TEXT NOT NULL,
    fingerprint TEXT NOT NULL, summary TEXT NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL REFERENCES runs(run_id), idx INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (run_id, idx));
"""


class ResultsStore:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else default_db_path()

    @contextmanager
    def _connect(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)  # transactions are explicit
        except sqlite3.Error as e:
            raise ValueError(f"cannot open the results store {self.path}: {e} "
                             "(set SPECDECODE_RESULTS_DB or pass --store to use another file)") from None
        with closing(conn):
            self._prepare(conn)
            yield conn

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """WAL mode and the schema. Switching to WAL takes an exclusive lock that the busy timeout
        does not cover, so a writer racing another one's first use retries here."""
        for _attempt in range(200):
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(SCHEMA)
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    raise ValueError(f"results store {self.path}: {e}") from None
                time.sleep(0.01 + 0.02 * random.random())
            except sqlite3.DatabaseError as e:
                raise ValueError(f"{self.path} is not a specdecode results store ({e}); "
                                 "pass --store with another path") from None
        raise ValueError(f"results store {self.path} stayed locked by another process for too long")

    def save(self, run: Run) -> None:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")  # take the write lock now (waits up to the busy timeout)
            try:
                conn.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                             (run.run_id, run.kind, run.created, json.dumps(run.fingerprint),
                              json.dumps(run.summary), json.dumps(run.meta)))
                conn.executemany("INSERT INTO records VALUES (?, ?, ?)",
                                 [(run.run_id, i, json.dumps(r)) for i, r in enumerate(run.records)])
            except BaseException:
                conn.execute("ROLLBACK")  # a run lands whole or not at all
                raise
            conn.execute("COMMIT")

    def list_runs(self, limit: int = 20) -> list[dict]:
        with self._connect() as conn:
            rows = conn.execute("SELECT run_id, kind, created, summary FROM runs ORDER BY created DESC, rowid DESC "
                                "LIMIT ?", (limit,)).fetchall()
        return [{"run_id": r[0], "kind": r[1], "created": r[2], "summary": json.loads(r[3])} for r in rows]

    def runs_of_kind(self, kind: str, limit: int = 50) -> list[Run]:
        """The newest ``limit`` runs of ``kind``, newest first, without their records."""
        with self._connect() as conn:
            rows = conn.execute("SELECT run_id, created, fingerprint, summary, meta FROM runs WHERE kind = ? "
                                "ORDER BY created DESC, rowid DESC LIMIT ?", (kind, limit)).fetchall()
        return [Run(r[0], kind, r[1], json.loads(r[2]), json.loads(r[3]), [], json.loads(r[4])) for r in rows]

    def resolve(self, ref: str) -> str:
        with self._connect() as conn:
            if ref == "latest":
                row = conn.execute("SELECT run_id FROM runs ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
                if row is None:
                    raise ValueError(f"the results store {self.path} has no runs yet")
                return row[0]
            ids = [r[0] for r in conn.execute("SELECT run_id FROM runs WHERE run_id LIKE ? || '%'", (ref,))]
        if len(ids) == 1:
            return ids[0]
        if not ids:
            raise ValueError(f"no run {ref!r} in {self.path} (see `specdecode runs` for the stored ids)")
        raise ValueError(f"run id prefix {ref!r} is ambiguous: {', '.join(sorted(ids)[:5])}")

    def load(self, ref: str) -> Run:
        run_id = self.resolve(ref)
        with self._connect() as conn:
            kind, created, fp, summary, meta = conn.execute(
                "SELECT kind, created, fingerprint, summary, meta FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            records = [json.loads(r[0]) for r in conn.execute(
                "SELECT record FROM records WHERE run_id = ? ORDER BY idx", (run_id,))]
        return Run(run_id, kind, created, json.loads(fp), json.loads(summary), records, json.loads(meta))


def append_jsonl(path: str | Path, run: Run) -> None:
    """Append the run header and its records; the lock keeps concurrent writers' lines whole."""
    lines = [json.dumps(run.header())] + [json.dumps({"type": "record", "run_id": run.run_id, **r})
                                          for r in run.records]
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write("\n".join(lines) + "\n")
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_jsonl(path: str | Path) -> list[Run]:
    runs: dict[str, Run] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}); is this a specdecode results file?") from None
            if obj.get("type") == "run":
                runs[obj["run_id"]] = Run(obj["run_id"], obj.get("kind", "bench"), obj.get("created", ""),
                                          obj.get("fingerprint", {}), obj.get("summary", []), [],
                                          obj.get("meta", {}))
            elif obj.get("type") == "record" and obj.get("run_id") in runs:
                runs[obj["run_id"]].records.append({k: v for k, v in obj.items() if k not in ("type", "run_id")})
    return list(runs.values())


def load_run(ref: str, store: ResultsStore | None = None) -> Run:
    """A run from a file (``F.jsonl``, ``F.jsonl#ID``, bench ``--out`` JSON) or from the store."""
    path, _, run_id = ref.partition("#")
    if Path(path).is_file():
        if path.endswith(".jsonl"):
            runs = read_jsonl(path)
            if not runs:
                raise ValueError(f"{path} holds no runs")
            if run_id:
                match = [r for r in runs if r.run_id.startswith(run_id)]
                if len(match) != 1:
                    raise ValueError(f"{path}: {'no' if not match else 'several'} runs match {run_id!r}; "
                                     f"ids: {', '.join(r.run_id for r in runs[:10])}")
                return match[0]
            return runs[-1]
        try:
            obj = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "summary" not in obj:
            raise ValueError(f"{path} is not a specdecode bench result (no 'summary')")
        fp = obj.get("fingerprint") or obj.get("environment") or {}
        return Run(obj.get("run_id", Path(path).stem), obj.get("kind", "bench"), obj.get("created", ""), fp,
                   obj["summary"], obj.get("records", []), {})
    if ref.endswith((".json", ".jsonl")):
        raise FileNotFoundError(f"results file {path} not found")
    return (store or ResultsStore()).load(ref)


def save_run(run: Run, store: ResultsStore | None, out: str | None = None) -> list[str]:
    """Append the run to the store and/or write it to ``out``; returns where it went. The caller
    decides who writes: under tensor parallelism only rank 0 (``Session.is_main``) should."""
    where = []
    if store is not None:
        store.save(run)
        where.append(f"store {store.path}")
    if out:
        if out.endswith(".jsonl"):
            append_jsonl(out, run)
        else:
            Path(out).write_text(json.dumps({"run_id": run.run_id, "kind": run.kind, "created": run.created,
                                             "fingerprint": run.fingerprint, "summary": run.summary,
                                             **run.meta, "records": run.records}, indent=1))
        where.append(out)
    return where


def now() -> str:
    """A run's ``created`` time stamp."""
    return time.strftime("%Y-%m-%d %H:%M:%S")
