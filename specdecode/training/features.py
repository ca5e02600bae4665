"""The target's side of training, computed once and kept on disk (``--feature-cache DIR``).

Online, every epoch runs the frozen target over every batch again: measured on the v3 data
(bf16, 2 threads, 2048-token batches), 0.92 s of the target per batch against 0.46 s for the
draft's 3-step training-time test, two thirds of each step. The target never changes, so the
store keeps what the draft needs from it, per token, in the data set's own layout (the
feature of token ``offset + i`` of a sample sits at row ``offset + i``):

- ``taps``: the aux hidden states entering the tapped layers, fused ([n_aux * H]);
- ``final``: the target's final hidden state after its norm ([H]);
- ``argmax``: the target's greedy next token (int32; for the accuracy the trainer reports).

More in docs/training.md.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.core.model import Transformer
from specdecode.io.paths import file_fingerprint
from specdecode.training.dataset import DataSet
from specdecode.training.ttt import TargetBatch, assemble_target_batch, collate

# numpy has no bfloat16: such rows are stored as their int16 bit patterns
_STORAGE = {torch.bfloat16: np.int16, torch.float16: np.float16, torch.float32: np.float32,
            torch.float64: np.float64}


BUILD_BATCH_TOKENS = 4096  # part of the store's key: a resumed build must cut the same batches


def _key(ds: DataSet, target: Transformer, aux: tuple[int, ...], max_len: int, model_id: str) -> dict:
    return {"data_tokens": file_fingerprint(ds.tokens_path), "model": model_id, "dtype": str(target.dtype),
            "aux": list(aux), "hidden": target.config.hidden_size, "max_len": max_len,
            "batch_tokens": BUILD_BATCH_TOKENS}


@dataclass
class FeatureStore:
    """Read/write access to a feature directory (see the module docstring)."""

    root: Path
    tokens: int  # rows: the data set's token count
    width: int  # n_aux * H
    hidden: int
    dtype: torch.dtype

    def _open(self, name: str, cols: int, np_dtype: type, mode: Any) -> np.memmap:
        shape = (self.tokens, cols) if cols else (self.tokens,)
        return np.memmap(self.root / f"{name}.bin", dtype=np_dtype, mode=mode, shape=shape)

    def arrays(self, mode: Any = "r") -> tuple[np.memmap, np.memmap, np.memmap]:
        st = _STORAGE[self.dtype]
        return (self._open("taps", self.width, st, mode), self._open("final", self.hidden, st, mode),
                self._open("argmax", 0, np.int32, mode))

    def to_tensor(self, a: np.ndarray) -> Tensor:
        t = torch.from_numpy(np.array(a))  # a copy: memmap views are read-only
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def from_tensor(self, t: Tensor) -> np.ndarray:
        t = t.detach().cpu().contiguous()
        return (t.view(torch.int16) if self.dtype == torch.bfloat16 else t).numpy()


@dataclass(frozen=True)
class FeatureProgress:
    done: int  # batches written
    total: int


def _batches(rows: list[dict], max_len: int, batch_tokens: int) -> list[list[int]]:
    """A fixed order (by length, then index: little padding), packed to ``batch_tokens``."""
    order = sorted(range(len(rows)), key=lambda i: (min(rows[i]["length"], max_len), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = min(rows[i]["length"], max_len)  # sorted: the widest so far
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def build_features(root: str | Path, ds: DataSet, target: Transformer, aux: tuple[int, ...], max_len: int,
                   model_id: str, on_progress: Callable[[FeatureProgress], None] | None = None) -> FeatureStore:
    """Compute (or finish) the store for the data set's training samples; returns it ready to
    read. Holds ``root/.lock`` while building: a concurrent caller waits, then finds it done."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _build(root, ds, target, aux, max_len, model_id, on_progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@torch.no_grad()
def _build(root: Path, ds: DataSet, target: Transformer, aux: tuple[int, ...], max_len: int, model_id: str,
           on_progress: Callable[[FeatureProgress], None] | None) -> FeatureStore:
    rows = ds.samples("train")
    key = _key(ds, target, aux, max_len, model_id)
    meta_path = root / "meta.json"
    ids = sorted(r["id"] for r in rows)
    meta: dict[str, Any] = {"key": key, "samples": len(ids), "batches_done": 0}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old.get("key") != key or old.get("samples") != len(ids):
            raise ValueError(f"{root}: the feature cache was made for other data or another target "
                             f"({old.get('key')}); give another --feature-cache directory or delete this one")
        meta = old
    n_tokens = ds.tokens_path.stat().st_size // 4
    store = FeatureStore(root, n_tokens, len(aux) * target.config.hidden_size, target.config.hidden_size,
                         target.dtype)
    batches = _batches(rows, max_len, BUILD_BATCH_TOKENS)
    tokens_mm = ds.tokens()
    taps, final, argmax = store.arrays("r+" if meta["batches_done"] else "w+")
    n = target.config.num_layers
    for b in range(meta["batches_done"], len(batches)):
        idx = batches[b]
        tokens, valid, _ = collate(ds, rows, idx, max_len, tokens_mm, target.device)
        B, T = tokens.shape
        out = target(tokens, torch.arange(T, device=tokens.device), target.new_cache(B, T),
                     hidden_layers=(*aux, n), logits_at=torch.zeros(0, dtype=torch.long, device=tokens.device))
        hid = torch.cat(out.hidden_states[:-1], -1)
        fin = target.norm(out.hidden_states[-1])
        for j, i in enumerate(idx):
            off, length = rows[i]["offset"], min(rows[i]["length"], T)
            taps[off:off + length] = store.from_tensor(hid[j, :length])
            final[off:off + length] = store.from_tensor(fin[j, :length])
            argmax[off:off + length] = target.lm_head(fin[j, :length]).argmax(-1).int().cpu().numpy()
        for a in (taps, final, argmax):
            a.flush()
        meta["batches_done"] = b + 1
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(meta_path)
        if on_progress:
            on_progress(FeatureProgress(b + 1, len(batches)))
    return store


def cached_target_batch(store: FeatureStore, arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
                        rows: list[dict], idx: list[int], needed: Tensor, draft_head: Tensor, t2d: Tensor,
                        target_to_draft: Tensor) -> TargetBatch:
    """``target_batch`` read from the store: taps as stored, the distribution over the draft
    vocabulary from the stored final hidden state and ``draft_head`` (the target's lm_head rows
    of the draft vocabulary, [Vd, H])."""
    taps, final, argmax = arrays
    B, T = needed.shape
    dev = needed.device
    hidden = torch.zeros(B, T, store.width, dtype=store.dtype)
    spans = []
    for b, i in enumerate(idx):
        off, length = rows[i]["offset"], min(rows[i]["length"], T)
        hidden[b, :length] = store.to_tensor(taps[off:off + length])
        spans.append(off)
    where = needed.flatten().nonzero().squeeze(1)
    b_of, t_of = (where // T).cpu().numpy(), (where % T).cpu().numpy()
    pos = np.asarray(spans, dtype=np.int64)[b_of] + t_of
    fin = store.to_tensor(final[pos]).to(dev)
    arg = torch.from_numpy(argmax[pos].astype(np.int64)).to(dev)
    return assemble_target_batch(hidden.to(dev), where, [F.linear(fin, draft_head)], [arg], t2d, target_to_draft,
                                 B, T)
