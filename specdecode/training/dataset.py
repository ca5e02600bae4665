"""A drafter training data set on disk, and the draft vocabulary drawn from it.

A data set is a directory:
- ``tokens.bin``: int32 token ids of every sample, appended;
- ``index.jsonl``: one line per sample: id, split, source, mode (greedy | sampled),
  offset and length into tokens.bin, and ``loss_ranges`` ([start, end) spans of
  assistant tokens, the only ones trained on);
- ``manifest.json``: the model it was generated with, counts, settings.
Appending is resumable: a sample is committed when its index line is written (after
its tokens are flushed), and a restart skips prompt ids already in the index.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import torch


class DataSet:
    """Read/append access to a data directory (see module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.index_path = self.root / "index.jsonl"
        self.tokens_path = self.root / "tokens.bin"
        self.manifest_path = self.root / "manifest.json"

    def exists(self) -> bool:
        return self.index_path.exists()

    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            raise FileNotFoundError(f"{self.manifest_path}: not found; build the data set with `specdecode data build`")
        return json.loads(self.manifest_path.read_text())

    def write_manifest(self, manifest: dict) -> None:
        """Replace manifest.json atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.manifest_path)

    def index(self) -> list[dict]:
        if not self.index_path.exists():
            raise FileNotFoundError(f"{self.index_path}: not found; build the data set with `specdecode data build`")
        rows = []
        size = self.tokens_path.stat().st_size // 4 if self.tokens_path.exists() else 0
        lines = self.index_path.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):
                    break  # a torn last line from an interrupted write: that sample is not committed
                raise ValueError(f"{self.index_path}:{n}: corrupt index line") from None
            if row["offset"] + row["length"] > size:
                raise ValueError(f"{self.index_path}:{n}: sample points past the end of tokens.bin (truncated?)")
            rows.append(row)
        return rows

    def tokens(self) -> np.ndarray:
        """Every whole token written so far (a torn tail from a writer killed mid-token is left out; read the
        index first, then this, and every indexed sample lies inside it while a build appends)."""
        return np.memmap(self.tokens_path, dtype=np.int32, mode="r", shape=(self.tokens_path.stat().st_size // 4,))

    def samples(self, split: str | None = None) -> list[dict]:
        return [r for r in self.index() if split is None or r["split"] == split]

    def read(self, row: dict, tokens: np.ndarray | None = None) -> tuple[list[int], list[bool]]:
        tokens = self.tokens() if tokens is None else tokens
        ids = tokens[row["offset"]: row["offset"] + row["length"]].tolist()
        mask = [False] * len(ids)
        for a, b in row["loss_ranges"]:
            mask[a:b] = [True] * (b - a)
        return ids, mask

    def append(self, rows: list[tuple[dict, list[int]]]) -> None:
        """Commit samples: tokens first (flushed), then their index lines. SIGINT and SIGTERM wait until both
        are written (a handler that raises, as `data build`'s does, would otherwise leave tokens without their
        index lines, or index lines that a retried append writes twice)."""
        blocked = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if hasattr(signal, "pthread_sigmask") else None
        try:
            self._append(rows)
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _append(self, rows: list[tuple[dict, list[int]]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.tokens_path, "ab") as f:
            # a torn tail from a killed writer is skipped: offsets come from the file size
            offset = f.tell() // 4
            if f.tell() % 4:
                f.truncate(offset * 4)
                f.seek(offset * 4)
            lines = []
            for meta, ids in rows:
                f.write(np.asarray(ids, dtype=np.int32).tobytes())
                lines.append(json.dumps(meta | {"offset": offset, "length": len(ids)}))
                offset += len(ids)
            f.flush()
        with open(self.index_path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()


# what every part of a merged data set must share: the model that answered (its file's fingerprint), the chat
# template its prompts were rendered with, and the held-out rule (a hash of the prompt id at this percent)
MERGE_KEYS = ("model_fingerprint", "chat_template_sha", "heldout_percent")


def merge(parts: list[str | Path], out: str | Path) -> dict:
    """Write the samples of ``parts`` (data sets of one model, chat template and held-out rule) into the new
    data set ``out``, in order; a prompt id already taken from an earlier part is left out (counted). The
    manifest keeps each part's own manifest under ``parts`` (how its answers were made: format, device
    kind, settings), so answers generated elsewhere (a GPU's, beside a CPU's) stay told apart. Returns the
    counts. The trainer reads the merged set as any other; the first part's rows come first, so its
    held-out samples stay the first ones (``train --eval-samples N`` measures on the same answers)."""
    if len(parts) < 2:
        raise ValueError("data merge needs at least two data sets")
    target = DataSet(out)
    if target.root.exists() and any(target.root.iterdir()):
        raise ValueError(f"{target.root} exists and is not empty; choose a new --out")
    sets = [DataSet(p) for p in parts]
    manifests = [ds.manifest() for ds in sets]
    for key in MERGE_KEYS:
        values = {json.dumps(m.get(key)) for m in manifests}
        if len(values) > 1:
            raise ValueError(f"the data sets differ in {key} ({', '.join(sorted(values))}): only data sets of one "
                             f"model, chat template and held-out rule merge")
    seen: set[str] = set()
    duplicates = 0
    # written beside ``out`` and moved into place whole: a merge cut short leaves no half data set behind
    work = DataSet(target.root.with_name(f".{target.root.name}.merging"))
    shutil.rmtree(work.root, ignore_errors=True)
    work.root.mkdir(parents=True)
    index: list[dict] = []
    with open(work.tokens_path, "wb") as f:
        offset = 0
        for ds in sets:
            rows = ds.index()  # before the tokens: a part still being built appends tokens first, then index lines
            tokens = ds.tokens()
            for row in rows:
                if row["id"] in seen:
                    duplicates += 1
                    continue
                seen.add(row["id"])
                chunk = np.asarray(tokens[row["offset"]:row["offset"] + row["length"]], dtype=np.int32)
                if len(chunk) != row["length"]:
                    raise ValueError(f"{ds.root}: sample {row['id']} points past the end of tokens.bin; is the data "
                                     f"set damaged? (`specdecode train` reads it the same way)")
                f.write(chunk.tobytes())
                index.append(row | {"offset": offset})
                offset += row["length"]
    work.index_path.write_text("".join(json.dumps(r) + "\n" for r in index))
    counts = summarize(index) | {"duplicates_left_out": duplicates}
    first = manifests[0]
    work.write_manifest({
        "format": first.get("format", "specdecode-data-v1"), "model": first.get("model"),
        **{key: first.get(key) for key in MERGE_KEYS},
        "prompt_files": sorted({f for m in manifests for f in m.get("prompt_files", [])}),
        "status": "merged", **counts,
        "parts": [{"path": str(ds.root)} | m for ds, m in zip(sets, manifests, strict=True)]})
    if target.root.exists():
        target.root.rmdir()  # empty (checked above)
    work.root.replace(target.root)
    return counts


def heldout_split(pid: str, percent: float) -> str:
    return "heldout" if int(pid[:8], 16) % 10000 < percent * 100 else "train"


def summarize(index: list[dict]) -> dict:
    """Sample, split and token counts of an index."""
    return {
        "samples": len(index), "train": sum(r["split"] == "train" for r in index),
        "heldout": sum(r["split"] == "heldout" for r in index),
        "assistant_tokens": assistant_tokens(index),
        "total_tokens": sum(r["length"] for r in index),
    }


def trains_inside(row: dict, max_len: int) -> bool:
    """Whether the training-time test has a position to learn from in ``row`` cut at ``max_len``: a
    trained token at index >= 2 (step 0 at index i predicts token i + 2) before the cut. A sample
    whose answers all start past the cut gives a step with no loss; in data v4, 170 of 15,168
    training samples (long prompts), paired by length, made 22 of 750 steps (3%) train nothing."""
    return any(min(b, max_len, row["length"]) > max(a, 2) for a, b in row["loss_ranges"])


def assistant_tokens(rows: list[dict]) -> int:
    return int(sum(b - a for r in rows for a, b in r["loss_ranges"]))


# ---------------------------------------------------------------- draft vocabulary

def token_counts(ds: DataSet, vocab_size: int, split: str = "train") -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokens = ds.tokens()
    for row in ds.samples(split):
        for a, b in row["loss_ranges"]:
            seg = tokens[row["offset"] + a: row["offset"] + b]
            counts += np.bincount(seg, minlength=vocab_size)[:vocab_size]
    return counts


def sample_token_counts(ds: DataSet, rows: list[dict], vocab_size: int, tokens: np.ndarray | None = None) -> np.ndarray:
    """Assistant-token counts of the given samples only."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for r in rows:
        ids, mask = ds.read(r, tokens)
        counts += np.bincount(np.asarray(ids)[np.asarray(mask)], minlength=vocab_size)
    return counts


def draft_vocab(counts: np.ndarray, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The ``size`` most frequent assistant tokens: (d2t offsets, t2d mask, coverage).
    Draft ids are assigned in ascending target-id order; ties favour lower ids."""
    vocab = len(counts)
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocab size must be in [1, {vocab}], got {size}")
    order = np.lexsort((np.arange(vocab), -counts))[:size]
    chosen = np.sort(order)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    d2t = torch.from_numpy(chosen - np.arange(size)).long()
    coverage = float(counts[chosen].sum() / max(counts.sum(), 1))
    return d2t, t2d, coverage


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """Target id -> draft id (-1 outside the draft vocabulary)."""
    index = torch.full((len(t2d),), -1, dtype=torch.long, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return index
