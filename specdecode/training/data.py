"""Training data made by the target itself (`specdecode data build`), and the draft vocab.

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

import argparse
import hashlib
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specdecode.core.engine import batch_generate
from specdecode.io.prompts import read_jsonl
from specdecode.io.loading import LoadedModel, load_model
from specdecode.io.paths import file_fingerprint
from specdecode.runtime.device import configure_threads, resolve_device
from specdecode.core.sampling import SamplingParams

SPEC_BENCH_HINT = "Spec-Bench is for evaluation only: never train a drafter on it"


@dataclass(frozen=True)
class PromptRecord:
    id: str
    source: str
    messages: tuple[dict, ...]


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def prompt_id(messages: tuple[dict, ...]) -> str:
    text = "\n".join(normalize(m["content"]) for m in messages)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def read_prompt_file(path: Path) -> Iterator[PromptRecord]:
    """self-instruct seed tasks / user-oriented instructions (instruction + instance input),
    or jsonl with ``prompt``, ``instruction`` (+ ``input``) or ``messages``."""
    if "spec_bench" in path.name.lower():
        raise ValueError(f"{path}: {SPEC_BENCH_HINT}")
    for n, row in read_jsonl(path):
        if "turns" in row and "question_id" in row:
            raise ValueError(f"{path}:{n}: looks like Spec-Bench (question_id, turns); {SPEC_BENCH_HINT}")
        if "messages" in row:
            messages = tuple(m for m in row["messages"] if m.get("role") != "assistant")
        elif "instruction" in row:
            inputs = [i.get("input", "") for i in row.get("instances", [])] or [row.get("input", "")]
            for inp in inputs[:2]:  # an instruction with up to two of its inputs
                text = row["instruction"] + (f"\n\n{inp}" if inp else "")
                msgs = _user(text)
                yield PromptRecord(prompt_id(msgs), path.stem, msgs)
            continue
        elif "prompt" in row:
            messages = _user(row["prompt"])
        else:
            raise ValueError(f"{path}:{n}: expected 'instruction', 'prompt' or 'messages'")
        yield PromptRecord(prompt_id(messages), path.stem, messages)


def dedupe(records: list[PromptRecord]) -> list[PromptRecord]:
    seen, out = set(), []
    for r in records:
        if r.id not in seen:
            seen.add(r.id)
            out.append(r)
    return out


def bootstrap_instructions(loaded: LoadedModel, seeds: list[PromptRecord], count: int, seed: int,
                           batch_size: int = 32, on_batch=None) -> list[PromptRecord]:
    """New instructions written by the target, self-instruct style: show it a few seed
    instructions and ask for a new one (sampled, so each request differs)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tok = loaded.tokenizer
    out: list[PromptRecord] = []
    params = SamplingParams(temperature=1.0, top_p=0.95)
    attempts = 0
    while len(out) < count and attempts < 4 * count + 64:
        prompts = []
        for _ in range(batch_size):
            examples = rng.sample(seeds, k=min(3, len(seeds)))
            listing = "\n".join(f"{i + 1}. {e.messages[-1]['content'].splitlines()[0][:200]}"
                                for i, e in enumerate(examples))
            ask = (f"Here are some example tasks:\n{listing}\n\nWrite one new task that is different from these. "
                   "Reply with the task only.")
            prompts.append(tok.encode_chat(ask))
        attempts += batch_size
        for ids in batch_generate(loaded.model, prompts, 48, params, tok.eos_token_ids, gen):
            text = tok.decode([t for t in ids if t not in tok.eos_token_ids]).strip().splitlines()
            text = re.sub(r"^\d+[.)]\s*", "", text[0]).strip() if text else ""
            if 15 <= len(text) <= 300:
                msgs = _user(text)
                out.append(PromptRecord(prompt_id(msgs), "bootstrapped", msgs))
        out = dedupe(out)
        if on_batch:
            on_batch(len(out), attempts)
    return out[:count]


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

    def index(self) -> list[dict]:
        if not self.index_path.exists():
            raise FileNotFoundError(f"{self.index_path}: not found; build the data set with `specdecode data build`")
        rows = []
        size = self.tokens_path.stat().st_size // 4 if self.tokens_path.exists() else 0
        for n, line in enumerate(self.index_path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if n == len(self.index_path.read_text().splitlines()):
                    break  # a torn last line from an interrupted write: that sample is not committed
                raise ValueError(f"{self.index_path}:{n}: corrupt index line") from None
            if row["offset"] + row["length"] > size:
                raise ValueError(f"{self.index_path}:{n}: sample points past the end of tokens.bin (truncated?)")
            rows.append(row)
        return rows

    def tokens(self) -> np.ndarray:
        return np.memmap(self.tokens_path, dtype=np.int32, mode="r")

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
        """Commit samples: tokens first (flushed), then their index lines."""
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


def heldout_split(pid: str, percent: float) -> str:
    return "heldout" if int(pid[:8], 16) % 10000 < percent * 100 else "train"


def build(args: argparse.Namespace) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    configure_threads(args.threads)
    loaded = load_model(args.model, args.dtype, resolve_device(args.device))
    tok = loaded.tokenizer
    ds = DataSet(args.out)
    done = {r["id"] for r in ds.index()} if ds.exists() else set()
    if ds.exists():
        m = ds.manifest()
        if m.get("model_fingerprint") and m["model_fingerprint"] != fingerprint(loaded):
            raise ValueError(f"{args.out} was generated by another model ({m.get('model')}); use a new --out")

    records: list[PromptRecord] = []
    for path in args.prompts:
        records += list(read_prompt_file(Path(path)))
    records = dedupe(records)
    console.print(f"{len(records)} unique seed prompts from {len(args.prompts)} file(s)")
    if args.bootstrap:
        boot_path = Path(args.out) / "bootstrapped.jsonl"
        if boot_path.exists():  # resumable: reuse the instructions made before
            boot = list(read_prompt_file(boot_path))
        else:
            t0 = time.perf_counter()
            with console.status("bootstrapping instructions") as status:
                boot = bootstrap_instructions(
                    loaded, records, args.bootstrap, args.seed, batch_size=args.batch_size,
                    on_batch=lambda n, tried: status.update(f"bootstrapping instructions: {n}/{args.bootstrap} "
                                                            f"kept of {tried} asked"))
            Path(args.out).mkdir(parents=True, exist_ok=True)
            boot_path.write_text("".join(json.dumps({"prompt": r.messages[0]["content"]}) + "\n" for r in boot))
            console.print(f"bootstrapped {len(boot)} new instructions in {time.perf_counter() - t0:.0f} s")
        records = dedupe(records + [PromptRecord(r.id, "bootstrapped", r.messages) for r in boot])
    rng = random.Random(args.seed)
    todo = [r for r in records if r.id not in done]
    rng.shuffle(todo)
    if args.limit:
        todo = todo[:max(0, args.limit - len(done))]
    write_manifest(ds, loaded, args, extra={"status": "building"})

    greedy = SamplingParams()
    sampled = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    gen = torch.Generator().manual_seed(args.seed + len(done))
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn())
    new_tokens = 0
    t0 = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("gen", total=len(todo), rate="")
        # sort by prompt length within a window: less padding per batch
        for start in range(0, len(todo), args.batch_size):
            batch = sorted(todo[start:start + args.batch_size], key=lambda r: len(r.messages[-1]["content"]))
            modes = ["sampled" if rng.random() < args.sampled_fraction else "greedy" for _ in batch]
            prompts = [tok.encode_chat(list(r.messages))[-args.max_prompt_tokens:] for r in batch]
            outs = batch_generate(loaded.model, prompts, args.max_new_tokens,
                                  [greedy if m == "greedy" else sampled for m in modes], tok.eos_token_ids, gen)
            rows = []
            for r, mode, p, o in zip(batch, modes, prompts, outs):
                meta = {"id": r.id, "split": heldout_split(r.id, args.heldout_percent), "source": r.source,
                        "mode": mode, "loss_ranges": [[len(p), len(p) + len(o)]]}
                rows.append((meta, p + o))
                new_tokens += len(o)
            ds.append(rows)
            rate = new_tokens / (time.perf_counter() - t0)
            progress.update(task, advance=len(batch), rate=f"{rate:.0f} new tok/s")
    index = ds.index()
    summary = {
        "samples": len(index), "train": sum(r["split"] == "train" for r in index),
        "heldout": sum(r["split"] == "heldout" for r in index),
        "assistant_tokens": sum(b - a for r in index for a, b in r["loss_ranges"]),
        "total_tokens": sum(r["length"] for r in index),
        "generated_this_run": new_tokens, "seconds_this_run": time.perf_counter() - t0,
    }
    write_manifest(ds, loaded, args, extra={"status": "complete", **summary})
    return summary


def fingerprint(loaded: LoadedModel) -> str:
    src = loaded.source
    return file_fingerprint(src) if src.is_file() else file_fingerprint(src / "config.json")


def write_manifest(ds: DataSet, loaded: LoadedModel, args: argparse.Namespace, extra: dict) -> None:
    ds.root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "specdecode-data-v1", "model": str(loaded.source), "model_fingerprint": fingerprint(loaded),
        "chat_template_sha": hashlib.sha256(str(getattr(loaded.tokenizer.hf, "chat_template", "")).encode()).hexdigest()[:16],
        "dtype": args.dtype, "prompt_files": [str(p) for p in args.prompts], "bootstrap": args.bootstrap,
        "max_new_tokens": args.max_new_tokens, "sampled_fraction": args.sampled_fraction,
        "temperature": args.temperature, "top_p": args.top_p, "heldout_percent": args.heldout_percent,
        "seed": args.seed, **extra,
    }
    tmp = ds.manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(ds.manifest_path)


# ---------------------------------------------------------------- draft vocabulary

def token_counts(ds: DataSet, vocab_size: int, split: str = "train") -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokens = ds.tokens()
    for row in ds.samples(split):
        for a, b in row["loss_ranges"]:
            seg = tokens[row["offset"] + a: row["offset"] + b]
            counts += np.bincount(seg, minlength=vocab_size)[:vocab_size]
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


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="data directory (created, or resumed if it exists)")
    p.add_argument("--prompts", nargs="+", required=True,
                   help="prompt files: self-instruct seed tasks, user-oriented instructions, or jsonl with "
                        "'prompt' / 'instruction' / 'messages' (Spec-Bench is refused)")
    p.add_argument("--bootstrap", type=int, default=0, help="new instructions to bootstrap with the target")
    p.add_argument("--limit", type=int, default=None, help="stop at this many samples in total")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sampled-fraction", type=float, default=0.3,
                   help="share of responses sampled (the rest greedy)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--heldout-percent", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)


def cmd_data_build(args: argparse.Namespace) -> int:
    summary = build(args)
    print(json.dumps(summary))
    return 0
