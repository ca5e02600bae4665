"""Training data made by the target itself (`specdecode data build`): seed prompts (and
instructions the target bootstraps from them) answered by the target, appended to a
resumable data set (``specdecode.training.dataset``) with a held-out split.

Prompt files are read by ``specdecode.io.prompts``; here they are deduplicated by content
and Spec-Bench (an evaluation set) is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdecode.core.batching import BatchConfig, generate_all
from specdecode.core.requests import GenerateOptions
from specdecode.core.runner import EAGER, StepRunner
from specdecode.core.sampling import SamplingParams
from specdecode.io.loading import LoadedModel
from specdecode.io.paths import file_fingerprint
from specdecode.io.prompts import is_spec_bench_row, read_prompt_rows, user
from specdecode.runtime.session import Session
from specdecode.training.dataset import DataSet, heldout_split, summarize

SPEC_BENCH_HINT = "Spec-Bench is for evaluation only: never train a drafter on it"
BOOTSTRAPPED = "bootstrapped.jsonl"  # inside the data directory: instructions made before (resumable)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataBuildConfig:
    """`specdecode data build`: where to write, what to answer and how."""

    out: str
    prompts: tuple[str, ...]
    bootstrap: int = 0  # new instructions to bootstrap with the target
    sample: int | None = None  # draw this many prompts, an equal share per category (sample_by_category)
    category_weights: tuple[tuple[str, float], ...] = ()  # share per category relative to 1.0 (sample_by_category)
    limit: int | None = None  # stop at this many samples in total
    max_new_tokens: int = 256
    max_prompt_tokens: int = 768
    batch_size: int = 32
    sampled_fraction: float = 0.3  # share of responses sampled (the rest greedy)
    temperature: float = 0.7
    top_p: float = 0.9
    heldout_percent: float = 5.0
    seed: int = 0
    # data sets whose prompts are not answered again (a second data set over a larger draw holds only new
    # prompts; ``dataset.merge`` joins them)
    skip_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuildProgress:
    """What ``build`` reports as it goes, by ``stage``:
    - "seeds": ``done`` unique seed prompts read from ``total`` files;
    - "bootstrap": ``done`` instructions kept of ``asked`` asked, ``total`` wanted;
    - "bootstrapped": ``done`` new instructions made in ``seconds``;
    - "generate": ``done`` of ``total`` prompts answered, ``new_tokens`` in ``seconds``."""

    stage: str
    done: int
    total: int
    asked: int = 0
    new_tokens: int = 0
    seconds: float = 0.0


OnBuildProgress = Callable[[BuildProgress], None]


@dataclass(frozen=True)
class PromptRecord:
    id: str
    source: str
    messages: tuple[dict, ...]
    category: str = ""  # coarse category (the file's "category" before any ":"); "" when the file has none


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def prompt_id(messages: tuple[dict, ...]) -> str:
    text = "\n".join(normalize(m["content"]) for m in messages)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_prompt_file(path: Path) -> list[PromptRecord]:
    """The prompts of a file for training (any chat format of ``specdecode.io.prompts``), identified
    by their content; the assistant turns of ``messages`` are dropped (the target answers)."""
    if "spec_bench" in path.name.lower():
        raise ValueError(f"{path}: {SPEC_BENCH_HINT}")
    records = []
    dropped = 0
    for n, row, prompts in read_prompt_rows(path):
        if is_spec_bench_row(row):
            raise ValueError(f"{path}:{n}: looks like Spec-Bench (question_id, turns); {SPEC_BENCH_HINT}")
        for p in prompts:
            if p.messages is None:
                raise ValueError(f"{path}:{n}: raw 'text' has no chat turn to answer; expected 'instruction', "
                                 "'prompt' or 'messages'")
            messages = tuple(m for m in p.messages if m.get("role") != "assistant")
            category = str(row.get("category") or "").split(":")[0]
            records.append(PromptRecord(prompt_id(messages), path.stem, messages, category))
            dropped += p.dropped_turns
    if dropped:
        log.warning("%s: %d conversation(s) opened with an assistant turn; it was left out (as SpecForge does) and "
                    "the first user turn asked", path, dropped)
    return records


def sample_by_category(records: list[PromptRecord], count: int, seed: int,
                       weights: dict[str, float] | None = None) -> list[PromptRecord]:
    """``count`` records with an equal share per category (records without one form their own
    group), or a share proportional to ``weights[category]`` (1.0 where not named; 0 leaves a
    category out); a category with fewer records than its share gives the rest to the others. The
    corpus is uneven (math and translation have thousands, writing and roleplay hundreds), so
    taking the union would train mostly on the largest categories. Deterministic for a seed, and
    nested: a larger ``count`` (same seed, same weights) keeps every record a smaller one drew,
    since each category is shuffled once and cut at its quota."""
    weights = weights or {}
    unknown = sorted(set(weights) - {r.category for r in records})
    if unknown:
        known = ", ".join(sorted({r.category for r in records if r.category}))
        raise ValueError(f"category weights name categories the prompt files lack: {', '.join(unknown)} "
                         f"(their categories: {known})")
    if any(w < 0 for w in weights.values()):
        raise ValueError("category weights must be >= 0")
    groups: dict[str, list[PromptRecord]] = {}
    for r in records:
        groups.setdefault(r.category, []).append(r)
    rng = random.Random(seed)
    for key in sorted(groups):
        rng.shuffle(groups[key])
    weight = {key: weights.get(key, 1.0) for key in groups}
    quota: dict[str, int] = dict.fromkeys(groups, 0)
    # the most constrained first (fewest records per unit of weight): a full category passes its rest on
    open_groups = sorted((k for k in groups if weight[k] > 0), key=lambda k: len(groups[k]) / weight[k])
    left = min(count, sum(len(groups[k]) for k in open_groups))
    while open_groups:
        key = open_groups.pop(0)
        share = left * weight[key] / (weight[key] + sum(weight[k] for k in open_groups))
        quota[key] = min(len(groups[key]), int(share))
        left -= quota[key]
    picked = [r for key in sorted(groups) for r in groups[key][:quota[key]]]
    rng.shuffle(picked)
    return picked


def dedupe(records: list[PromptRecord]) -> list[PromptRecord]:
    seen, out = set(), []
    for r in records:
        if r.id not in seen:
            seen.add(r.id)
            out.append(r)
    return out


def bootstrap_instructions(loaded: LoadedModel, seeds: list[PromptRecord], count: int, seed: int,
                           batch_size: int = 32, on_batch: Callable[[int, int], None] | None = None,
                           runner: StepRunner = EAGER) -> list[PromptRecord]:
    """New instructions written by the target, self-instruct style: show it a few seed
    instructions and ask for a new one (sampled, so each request differs).
    ``on_batch(kept, asked)`` after each batch."""
    rng = random.Random(seed)
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
        options = [GenerateOptions(48, replace(params, seed=rng.randrange(2**63))) for _ in prompts]
        for ids in generate_all(loaded.model, prompts, options, tok.eos_token_ids, BatchConfig(slots=batch_size),
                                runner=runner):
            lines = tok.decode([t for t in ids if t not in tok.eos_token_ids]).strip().splitlines()
            text = re.sub(r"^\d+[.)]\s*", "", lines[0]).strip() if lines else ""
            if 15 <= len(text) <= 300:
                msgs = user(text)
                out.append(PromptRecord(prompt_id(msgs), "bootstrapped", msgs))
        out = dedupe(out)
        if on_batch:
            on_batch(len(out), attempts)
    return out[:count]


def _bootstrapped(cfg: DataBuildConfig, loaded: LoadedModel, seeds: list[PromptRecord],
                  report: OnBuildProgress, runner: StepRunner) -> list[PromptRecord]:
    """The bootstrapped instructions: read back if made before (resumable), else made and saved."""
    boot_path = Path(cfg.out) / BOOTSTRAPPED
    if boot_path.exists():
        return read_prompt_file(boot_path)
    t0 = time.perf_counter()
    boot = bootstrap_instructions(
        loaded, seeds, cfg.bootstrap, cfg.seed, batch_size=cfg.batch_size,
        on_batch=lambda n, tried: report(BuildProgress("bootstrap", n, cfg.bootstrap, asked=tried)), runner=runner)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    boot_path.write_text("".join(json.dumps({"prompt": r.messages[0]["content"]}) + "\n" for r in boot))
    report(BuildProgress("bootstrapped", len(boot), cfg.bootstrap, seconds=time.perf_counter() - t0))
    return boot


def answer_draw(seed: int, pid: str) -> tuple[float, int]:
    """A prompt's draw for its answer: a uniform number in [0, 1) (sampled below --sampled-fraction, else greedy)
    and its sampling seed, from the build's seed and the prompt's id alone."""
    digest = hashlib.sha256(f"{seed}:{pid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64, int.from_bytes(digest[8:16], "big") >> 1


def build(cfg: DataBuildConfig, session: Session, on_progress: OnBuildProgress | None = None) -> dict:
    """Append the target's answers to ``cfg.out`` (resuming: prompts already there are skipped);
    returns the data set's counts and this run's generated tokens and seconds."""
    report = on_progress or (lambda _: None)
    loaded = session.loaded
    tok = loaded.tokenizer
    ds = DataSet(cfg.out)
    done = {r["id"] for r in ds.index()} if ds.exists() else set()
    if ds.exists():
        m = ds.manifest()
        if m.get("model_fingerprint") and m["model_fingerprint"] != fingerprint(loaded):
            raise ValueError(f"{cfg.out} was generated by another model ({m.get('model')}); use a new --out")
        check_resume(m, manifest_of(session, cfg), cfg.out)
    skip: set[str] = set()
    for other in cfg.skip_from:
        skip |= {r["id"] for r in DataSet(other).index()}

    records: list[PromptRecord] = []
    for path in cfg.prompts:
        records += read_prompt_file(Path(path))
    records = dedupe(records)
    if cfg.sample:
        records = sample_by_category(records, cfg.sample, cfg.seed, dict(cfg.category_weights))
    report(BuildProgress("seeds", len(records), len(cfg.prompts)))
    if cfg.bootstrap:
        boot = _bootstrapped(cfg, loaded, records, report, session.runner)
        records = dedupe(records + [PromptRecord(r.id, "bootstrapped", r.messages) for r in boot])
    # The order, and each prompt's mode and seed, depend on the seed and the prompts alone, not on what an
    # interrupted build already answered: a resumed build makes the data set an uninterrupted one makes.
    todo = [r for r in records if r.id not in skip]
    random.Random(cfg.seed).shuffle(todo)
    todo = [r for r in todo if r.id not in done]
    if cfg.limit:
        todo = todo[:max(0, cfg.limit - len(done))]
    if not todo and ds.exists():  # nothing to add: leave the data set, manifest included, as it is
        return summarize(ds.index()) | {"generated_this_run": 0, "seconds_this_run": 0.0}
    write_manifest(ds, session, cfg, extra={"status": "building"})

    sampled = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    draws = [answer_draw(cfg.seed, r.id) for r in todo]
    modes = ["sampled" if u < cfg.sampled_fraction else "greedy" for u, _ in draws]
    options = [GenerateOptions(cfg.max_new_tokens, SamplingParams() if mode == "greedy" else
                               replace(sampled, seed=seed)) for mode, (_, seed) in zip(modes, draws, strict=True)]
    prompts = [tok.encode_chat(list(r.messages))[-cfg.max_prompt_tokens:] for r in todo]
    new_tokens = answered = 0
    rows: list[tuple[dict, list[int]]] = []
    t0 = time.perf_counter()
    report(BuildProgress("generate", 0, len(todo)))

    def flush() -> None:
        pending = rows[:]  # taken first: an interrupt after this point cannot make the finally below append twice
        rows.clear()
        ds.append(pending)  # appended as answers finish: a killed build resumes from what was saved
        if answered % cfg.batch_size == 0 or answered == len(todo):
            report(BuildProgress("generate", answered, len(todo), new_tokens=new_tokens,
                                 seconds=time.perf_counter() - t0))

    def finished(i: int, ids: list[int]) -> None:
        nonlocal new_tokens, answered
        r, p = todo[i], prompts[i]
        meta = {"id": r.id, "split": heldout_split(r.id, cfg.heldout_percent), "source": r.source,
                "mode": modes[i], "loss_ranges": [[len(p), len(p) + len(ids)]]}
        rows.append((meta, p + ids))
        new_tokens += len(ids)
        answered += 1
        flush()  # each answer as it finishes (a few per second at most: two small appends)

    # Continuous batching: a finished answer's slot takes the next prompt at once.
    # Slots sized to what a sample can hold (the model's whole context per slot reserved 12 GB of
    # keys/values for 64 slots of SmolLM2); 128 slots or a larger prefill chunk gained little (docs/LOG.md).
    batch = BatchConfig(slots=cfg.batch_size, slot_tokens=cfg.max_prompt_tokens + cfg.max_new_tokens,
                        spec_policy="never")
    try:
        generate_all(loaded.model, prompts, options, tok.eos_token_ids, batch, on_done=finished,
                     runner=session.runner)
    finally:  # stopped (Ctrl-C, SIGTERM: the CLI raises KeyboardInterrupt) or done: keep every finished answer
        if rows:
            flush()
    summary = summarize(ds.index()) | {"generated_this_run": new_tokens,
                                       "seconds_this_run": time.perf_counter() - t0}
    write_manifest(ds, session, cfg, extra={"status": "complete", **summary})
    return summary


def fingerprint(loaded: LoadedModel) -> str:
    src = loaded.source
    return file_fingerprint(src) if src.is_file() else file_fingerprint(src / "config.json")


# A resumed build must make its answers as the data set's were made, or the manifest would describe
# answers it did not make: these settings are compared (those a manifest holds; older ones lack some).
# The device kind is not among them (the same format on another device rounds alike to within a
# near-tie); the draw (--sample, --category-weights, the prompt files) may grow, it nests.
RESUME_SETTINGS = ("dtype", "weights", "chat_template_sha", "max_new_tokens", "max_prompt_tokens",
                   "sampled_fraction", "heldout_percent", "seed")
SAMPLED_SETTINGS = ("temperature", "top_p")  # compared where answers are sampled


def check_resume(old: dict, new: dict, out: str) -> None:
    """Refuse to resume a data set made with other generation settings, naming them and the fix."""
    if old.get("status") == "merged":
        raise ValueError(f"{out} was made by `data merge` (its parts were built with their own settings); build into "
                         f"a new --out with --skip-from {out}, then merge again")
    keys = RESUME_SETTINGS + (SAMPLED_SETTINGS if new.get("sampled_fraction") or old.get("sampled_fraction") else ())
    differ = [f"{k} {old[k]!r} -> {new[k]!r}" for k in keys if k in old and k in new and old[k] != new[k]]
    if differ:
        raise ValueError(f"{out} was built with other settings ({'; '.join(differ)}): its answers and these would "
                         f"mix under one manifest. Resume with its settings, or build a new --out (with --skip-from "
                         f"{out} to leave its prompts out) and join the two with `specdecode data merge`")


# the draw and generation settings ``settings_like`` copies from a data set's manifest (DataBuildConfig fields)
LIKE_SETTINGS = ("sample", "category_weights", "max_new_tokens", "max_prompt_tokens", "sampled_fraction",
                 "temperature", "top_p", "heldout_percent", "seed")


def settings_like(data: str | Path, prompts_dir: str | Path | None = None) -> dict[str, Any]:
    """The draw and generation settings of the data set at ``data`` (a merged one: its first part's), as
    DataBuildConfig fields with its prompt files in their order (the order decides the draw): a build with them and
    a larger ``sample`` answers more of the same draw (with ``skip_from=(data,)``: only the new prompts). With
    ``prompts_dir``, each prompt file is looked up there by name (a file under a ``long/`` directory under its
    ``long/``), for a machine where the corpus lies elsewhere. The target's format (dtype, weights) is not copied:
    the build's own flags decide it; nor is DATA's own ``skip_from`` (paths of another machine, perhaps)."""
    path = Path(data) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--like {data}: no data set there ({path} is missing)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--like {data}: {path} is not valid JSON ({e})") from None
    made = manifest
    while "seed" not in made and made.get("parts"):  # a merged set (perhaps merged again): its first part's
        made = made["parts"][0]
    missing = [k for k in ("prompt_files", "seed", "heldout_percent", "max_new_tokens", "sampled_fraction")
               if k not in made]
    if missing:
        raise ValueError(f"--like {data}: its manifest lacks {', '.join(missing)}: not a data set `specdecode data "
                         f"build` made; give the settings as flags instead")
    defaults = DataBuildConfig(out="", prompts=())
    out: dict[str, Any] = {k: made.get(k, getattr(defaults, k)) for k in LIKE_SETTINGS}
    out["category_weights"] = tuple((str(k), float(v)) for k, v in (made.get("category_weights") or {}).items())
    prompts = []
    for f in made["prompt_files"]:
        p = Path(f)
        if prompts_dir is not None:
            p = Path(prompts_dir) / ("long" if p.parent.name == "long" else "") / p.name
        if not p.is_file():
            where = f"under --prompts-dir {prompts_dir}" if prompts_dir is not None else "where its manifest says"
            raise ValueError(f"--like {data}: its prompt file {p.name} is not {where} ({p}); give --prompts-dir, "
                             f"the directory that holds the corpus's prompt files")
        prompts.append(str(p))
    out["prompts"] = tuple(prompts)
    return out


def manifest_of(session: Session, cfg: DataBuildConfig) -> dict:
    """What a data set built by ``cfg`` in ``session`` records of how it was made."""
    loaded = session.loaded
    template = str(getattr(loaded.tokenizer.hf, "chat_template", ""))
    return {
        "format": "specdecode-data-v1", "model": str(loaded.source), "model_fingerprint": fingerprint(loaded),
        "chat_template_sha": hashlib.sha256(template.encode()).hexdigest()[:16],
        "dtype": session.config.dtype, "weights": session.config.weights, "device": session.device.type,
        "prompt_files": [str(p) for p in cfg.prompts], "sample": cfg.sample,
        **({"category_weights": dict(cfg.category_weights)} if cfg.category_weights else {}),
        **({"skip_from": list(cfg.skip_from)} if cfg.skip_from else {}),
        "bootstrap": cfg.bootstrap,
        "max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens": cfg.max_prompt_tokens,
        "sampled_fraction": cfg.sampled_fraction,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "heldout_percent": cfg.heldout_percent,
        "seed": cfg.seed,
    }


def write_manifest(ds: DataSet, session: Session, cfg: DataBuildConfig, extra: dict) -> None:
    ds.write_manifest(manifest_of(session, cfg) | extra)
