"""The default speculative shape: ``--spec-config auto`` (the default of every command and of
``DecoderSpec()``) is decided here and nowhere else.

Two measurements meet in ``core.costmodel``: what a cycle of each candidate shape costs on this
machine (``core.calibrate``: measured once per CPU/GPU, torch build, threads, model file,
format, kernel plan, drafter file and engine code, about 2-10 s, then cached in
``$SPECDECODE_CACHE/spec-costs/`` beside the kernel plans), and how often the drafter's
proposals are accepted at each draft position (``acceptance.json`` shipped with the drafter,
measured by ``eval-drafter --acceptance-table`` on held-out answers). The shape with the highest
predicted speedup over plain decoding (timed beside it) wins. Flags given (``--num-steps``, ``--topk``,
``--num-draft-tokens``) are kept and the rest chosen around them; steps and top-k given leave
nothing to choose, and ``--spec-config static`` takes ``SpecConfig()`` under the flags. A drafter
without an acceptance table (a foreign or random one) gets ``SpecConfig()`` too, and the choice
says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode import __version__
from specdecode.core.calibrate import measure_cycle_costs
from specdecode.core.compiled import CompiledRunner, stored_only
from specdecode.core.costmodel import (
    AcceptanceTable,
    AdaptiveShape,
    AutoSpec,
    CycleCosts,
    Prediction,
    best_shape,
    candidate_shapes,
)
from specdecode.core.quant import detect_format
from specdecode.core.runner import Drafter
from specdecode.core.speculative import SpecConfig
from specdecode.io.checkpoints import ACCEPTANCE_FILE, read_acceptance
from specdecode.io.paths import cache_root, file_fingerprint, file_hash
from specdecode.runtime.kernels import hardware_key
from specdecode.runtime.session import Session

SPEC_MODES = ("auto", "static")
# What the calibration decodes after (its content barely matters: costs are priced per phase,
# the re-extend per token count); about 130 tokens with the chat template, a typical prompt.
CALIBRATION_PROMPT = ("Explain, step by step and with one worked example, how a hash table resolves collisions "
                      "with open addressing and with separate chaining, when each is faster, what load factor "
                      "means for both, and why resizing keeps lookups fast on average. Then write a short "
                      "Python function that inserts a key into an open-addressing table with linear probing.")


@dataclass
class SpecChoice:
    """The shape a decoder runs and how it was decided (recorded by ``--json``, bench and serve)."""

    config: SpecConfig
    # auto (measured) | flags (every field given) | static (SpecConfig() under the flags) | fallback | deferred
    how: str
    reason: str
    # auto only: every shape is predicted slower than plain decoding (the factory then decodes plain
    # unless the caller insists on speculation: a bench method named eagle3, shape flags)
    plain_is_faster: bool = False
    prediction: Prediction | None = None
    baseline_ms: float | None = None
    costs_source: str | None = None  # "measured in 4.1 s, cached in PATH" | "cached PATH"
    acceptance_source: str | None = None
    measure_s: float = 0.0  # time spent measuring now (0 when cached)
    choose_s: float = 0.0  # time this choice took, measuring included
    candidates: list[dict] = field(default_factory=list)  # every predicted shape, fastest first
    # what the choice was made from (kept for --adapt, which re-chooses among ``shapes`` while decoding)
    shapes: list[SpecConfig] = field(default_factory=list, repr=False)
    acceptance: AcceptanceTable | None = field(default=None, repr=False)
    costs: CycleCosts | None = field(default=None, repr=False)

    def adaptive(self, every: int = 8) -> Callable[[], AdaptiveShape] | None:
        """A factory of per-request shape policies (``--adapt``), or None where nothing was measured."""
        if self.how != "auto" or self.acceptance is None or self.costs is None:
            return None
        shapes, table, costs, first = list(self.shapes), self.acceptance, self.costs, self.config
        return lambda: AdaptiveShape(shapes, table, costs, first, every=every)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"how": self.how, "reason": self.reason, "num_steps": self.config.num_steps,
                               "topk": self.config.topk, "num_draft_tokens": self.config.num_draft_tokens,
                               "plain_is_faster": self.plain_is_faster}
        if self.prediction is not None:
            out |= {"predicted_accept_length": round(self.prediction.accept_length, 3),
                    "predicted_tok_per_s": round(self.prediction.tok_per_s, 1),
                    "predicted_speedup": round(self.prediction.speedup, 3),
                    "baseline_ms_per_token": self.baseline_ms, "costs": self.costs_source,
                    "acceptance": self.acceptance_source, "measure_s": round(self.measure_s, 2),
                    "choose_s": round(self.choose_s, 3), "candidates": self.candidates}
        return out

    def summary(self) -> str:
        c = self.config
        shape = f"{c.num_steps} steps, top-{c.topk}, {c.num_draft_tokens} tokens"
        if self.prediction is None:
            return f"speculative shape {shape} ({self.how}: {self.reason})"
        p = self.prediction
        head = (f"plain decoding (auto: the best speculative shape, {shape}, is predicted at {p.speedup:.2f}x"
                if self.plain_is_faster else f"speculative shape {shape} (auto: predicted {p.speedup:.2f}x plain "
                f"decoding, accept length {p.accept_length:.2f}")
        return f"{head}; costs {self.costs_source}; acceptance {self.acceptance_source})"


def load_acceptance(drafter_path: str | None) -> AcceptanceTable | str:
    """The drafter's acceptance table, or why it has none that auto can use: no table, or one measured on other
    weights than its model.safetensors (the table records their fingerprint: a drafter trained again into the same
    directory keeps the old table). The file is read once."""
    data = read_acceptance(drafter_path) if drafter_path and Path(drafter_path).is_dir() else None
    if drafter_path is None or data is None:  # no file, or no drafter directory (a random drafter)
        return f"the drafter has no {ACCEPTANCE_FILE} (make one with `specdecode eval-drafter --acceptance-table`)"
    m = data.get("measured", {})
    weights = Path(drafter_path) / "model.safetensors"
    recorded = m.get("drafter_weights")
    if recorded and weights.is_file() and recorded != file_fingerprint(weights):
        return (f"{Path(drafter_path).name}/{ACCEPTANCE_FILE} was measured on other weights than its "
                f"model.safetensors (measure it again with `specdecode eval-drafter --acceptance-table`)")
    sets = m.get("data")
    of = f" of {len(sets)} data sets" if isinstance(sets, list) and len(sets) > 1 else ""
    source = (f"{Path(drafter_path).name}/{ACCEPTANCE_FILE} ({m.get('samples', '?')} held-out answers{of}, "
              f"{m.get('dtype', '?')}/{m.get('weights', '?')})")
    return AcceptanceTable(data["per_position_accept"], source, m.get("dtype"), m.get("weights"))


def acceptance_table(drafter_path: str | None) -> AcceptanceTable | None:
    """The drafter's acceptance table; None where auto cannot use one (``load_acceptance`` says why)."""
    table = load_acceptance(drafter_path)
    return None if isinstance(table, str) else table


def _code_digest() -> str:
    """The engine code the costs were measured with: a change to core/ measures again."""
    core = Path(__file__).resolve().parent.parent / "core"
    h = hashlib.sha256()
    for p in sorted(core.glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def costs_key(session: Session, drafter: torch.nn.Module, drafter_path: str) -> dict[str, object]:
    src = session.loaded.source

    return hardware_key(session.loaded.model, session.threads) | {
        "device": str(session.device),
        "gpu": torch.cuda.get_device_name(session.device) if session.device.type == "cuda" else None,
        "model": file_fingerprint(src) if src.is_file() else file_hash(src / "config.json"),
        "dtype": session.config.dtype, "weights": session.config.weights,
        "kernel_plan": hashlib.sha256(json.dumps(session.kernels.choices, sort_keys=True).encode()).hexdigest()[:16],
        # the weights and config only: a new acceptance.json or README does not change what a cycle costs
        "drafter": [file_hash(Path(drafter_path) / f) for f in ("config.json", "model.safetensors")]
        if drafter_path and Path(drafter_path).is_dir() else drafter_path,
        "drafter_dtype": str(next(drafter.parameters()).dtype), "drafter_weights": detect_format(drafter),
        "specdecode": __version__, "core_code": _code_digest(), "shapes": [str(s) for s in candidate_shapes()],
        "tensor_parallel": session.world_size,
        "graphs": calibration_graphs(session, drafter),
    }


def calibration_graphs(session: Session, drafter: torch.nn.Module) -> list[str] | None:
    """The stored graphs a calibration times (``stored_only``): None when it runs eager. A graph
    stored later (``specdecode compile``) changes the key, so the costs are measured again."""
    runner = stored_only(session.runner)
    if not isinstance(runner, CompiledRunner) or runner.store is None:
        return None
    return runner.store.names(session.loaded.model) + runner.store.names(drafter)


def costs_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / "spec-costs" / f"{digest}.json"


def cycle_costs(session: Session, drafter: Drafter, drafter_path: str,
                log: Callable[[str], None] | None = None) -> tuple[CycleCosts, str, float]:
    """The cached costs for this setting, or measured now and cached: (costs, source, seconds measuring)."""
    key = costs_key(session, drafter, drafter_path)  # type: ignore[arg-type]
    path = costs_path(key)
    if path.exists():
        try:
            return CycleCosts.from_dict(json.loads(path.read_text())["costs"]), f"cached {path}", 0.0
        except (ValueError, KeyError, TypeError) as e:
            if log:
                log(f"speculative cost table {path} not usable ({e}); measuring again")
    if log:
        log("measuring speculative cycle costs on this machine (once per model, format, drafter and threads)")
    tok = session.loaded.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": CALIBRATION_PROMPT}])
    t0 = time.perf_counter()
    # Measured with the steps the run decodes with, as far as they are stored: a stored graph runs
    # compiled, every other bucket eager, as it would in the run (``stored_only``); nothing compiles
    # now (each candidate's verify and draft sizes would first build their own graphs, minutes each on
    # a small CPU). Eager costs alone chose wrong beside stored graphs: on the Zen4 EPYC (bf16 + q4,
    # benchmarks/archive/compiled_vs_llamacpp.sh) auto predicted 1.11x for 2/1/3 from eager costs and it ran
    # at 0.87x the compiled plain decoding.
    costs = measure_cycle_costs(session.loaded.model, drafter, candidate_shapes(), prompt,
                                runner=stored_only(session.runner))
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)  # two processes may measure at once
    with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "costs": costs.to_dict(), "seconds": round(seconds, 2)}, f, indent=1, default=str)
    os.replace(tmp, path)
    return costs, f"measured in {seconds:.1f} s, cached in {path}", seconds


# What a run that defers the timing (``choose_spec(defer=True)``) decodes with until the costs are measured: the
# cheapest speculative cycle (one draft step, a verify of 2 tokens); at 4 bits the shape auto picked most often.
DEFERRED_SHAPE = SpecConfig(1, 1, 2)


def choose_spec(request: AutoSpec | SpecConfig, session: Session, drafter: Drafter, drafter_path: str | None,
                log: Callable[[str], None] | None = None, defer: bool = False) -> SpecChoice:
    """The shape to decode with (see the module doc). ``defer``: where the cycle costs of this setting are
    not cached yet, decode ``DEFERRED_SHAPE`` (or the static shape under the flags given) instead of timing
    them before the first token (a first run, whose background build times them: ``specdecode compile``)."""
    t0 = time.perf_counter()
    if isinstance(request, SpecConfig):
        return SpecChoice(request, "static", "--spec-config static: SpecConfig() under the flags given")
    if request.complete:
        return SpecChoice(request.static(), "flags", "steps and top-k given: nothing left to choose")
    if session.world_size > 1:  # each rank would time its own cycles and could choose another shape
        return SpecChoice(request.static(), "fallback",
                          f"tensor parallelism ({session.world_size} ranks): the ranks must decode one shape, "
                          "so SpecConfig() under the flags given")
    table = load_acceptance(drafter_path)
    if isinstance(table, str):
        return SpecChoice(request.static(), "fallback", table + ": SpecConfig() under the flags given")
    shapes = [s for s in candidate_shapes(request.num_draft_tokens) if request.admits(s) and table.covers(s)]
    if not shapes:
        return SpecChoice(request.static(), "fallback",
                          f"no measured candidate shape has {request.fields()}: SpecConfig() under the flags given")
    if defer and not costs_path(costs_key(session, drafter, drafter_path or "")).exists():  # type: ignore[arg-type]
        shape = request.static() if request.fields() else DEFERRED_SHAPE
        return SpecChoice(shape, "deferred", "no cycle costs measured for this setting yet, so the cheapest "
                          "speculative cycle until the build that follows this run times them")
    costs, source, measured = cycle_costs(session, drafter, drafter_path or "", log)
    ranked = best_shape(shapes, table, costs)
    if not ranked:
        return SpecChoice(request.static(), "fallback", "no candidate could be predicted")
    best = ranked[0]
    reason = "the highest predicted speedup over plain decoding among the candidates"
    plain = best.speedup < 1 and not request.fields()
    if best.speedup < 1:
        reason += f"; even it is predicted at {best.speedup:.2f}x plain decoding on this machine and format"
    measured_in = (table.measured_dtype, table.measured_weights)
    if None not in measured_in and measured_in != (session.config.dtype, session.config.weights):
        reason += (f"; the acceptance table was measured in {'/'.join(map(str, measured_in))}, this run is "
                   f"{session.config.dtype}/{session.config.weights}")
    return SpecChoice(best.shape, "auto", reason, plain, best,
                      costs.baseline_ms, source, table.source, measured, time.perf_counter() - t0,
                      [p.to_dict() for p in ranked], shapes, table, costs)

