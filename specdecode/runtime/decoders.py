"""The one decoder factory: every command (``generate``, ``bench``, ``sweep``, ``check``,
``serve``) turns a ``DecoderSpec`` into a token decoder here, so a configuration means the
same thing wherever it is named."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdecode.core.costmodel import AutoSpec
from specdecode.core.drafter import Eagle3Drafter, random_drafter
from specdecode.core.engine import BaselineDecoder, TokenDecoder
from specdecode.core.prune import VerifyBudget
from specdecode.core.quant import DRAFTER_WEIGHT_FORMATS, quantize_linears, set_activations
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.checkpoints import Convention, load_drafter
from specdecode.io.paths import shipped_drafter_for
from specdecode.runtime.autoformat import AUTO, resolve_drafter_weights
from specdecode.runtime.autospec import SpecChoice, choose_spec, cycle_costs
from specdecode.runtime.kernels import install_kernels
from specdecode.runtime.session import Session

RANDOM_DRAFTER = "random"  # an untrained head wired to the target (profiling the machinery)
RANDOM_DRAFT_VOCAB = 8192  # a realistic reduced draft vocabulary for the random head


@dataclass(frozen=True)
class DecoderSpec:
    """What to decode with. ``DecoderSpec()`` = speculative with the shipped drafter (for the
    default model) and the shape chosen by measurement (``AutoSpec()``, ``runtime.autospec``); a
    ``SpecConfig`` is decoded as given; ``speculative=False`` is the baseline."""

    speculative: bool = True
    drafter: str | None = None  # a drafter directory, "random", or None: the shipped one for the default model
    config: SpecConfig | AutoSpec = field(default_factory=AutoSpec)
    aux_layer_convention: Convention | None = None
    sync: bool = True  # CUDA: synchronize at phase boundaries (honest phase times)
    adapt: bool = False  # re-choose the shape while decoding from the request's own acceptance (auto only)
    # auto may decode plain where every shape is predicted slower; False insists on speculation
    # (a bench method named eagle3 measures speculation, whatever the prediction)
    allow_plain: bool = True
    # auto without cached cycle costs: decode a cheap shape now rather than time them first (runtime.autospec
    # DEFERRED_SHAPE; generate's first run, whose background build times them)
    defer_costs: bool = False
    # tokens a cycle may add from the request's own text beside the head's draft (``SpecConfig.ngram``; 0: none)
    ngram: int = 0
    # verify only what pays each cycle, from the proposers' confidence and the measured cycle costs (core.prune)
    verify_budget: bool = False
    # the drafter's linear layers: core.quant.DRAFTER_WEIGHT_FORMATS, or auto (runtime.autoformat decides)
    drafter_weights: str = AUTO

    def __post_init__(self) -> None:
        if self.drafter_weights != AUTO and self.drafter_weights not in DRAFTER_WEIGHT_FORMATS:
            raise ValueError(f"unknown drafter weights {self.drafter_weights!r}; use auto or one of "
                             f"{', '.join(DRAFTER_WEIGHT_FORMATS)}")
        if self.ngram < 0:
            raise ValueError(f"ngram must be 0 (off) or more tokens per cycle, got {self.ngram}")
        if self.ngram and self.adapt:
            raise ValueError("--adapt re-chooses among the head's shapes and would drop --ngram's proposals: "
                             "use one of them")


@dataclass
class Decoder:
    decode: TokenDecoder
    description: str  # "baseline" or "eagle3 (drafter PATH, steps=..., topk=..., draft_tokens=...)"
    drafter_path: str | None = None
    config: SpecConfig | None = None  # None for the baseline
    choice: SpecChoice | None = None  # how the shape was chosen (None for the baseline)
    notes: list[str] = field(default_factory=list)  # what was asked for and does not apply, said to the user
    drafter_weights: str | None = None  # the drafter's weight format (None for the baseline)

    @property
    def is_speculative(self) -> bool:
        return self.config is not None


def resolve_drafter_path(spec: DecoderSpec, session: Session) -> str | None:
    """The drafter to use: the spec's, else the shipped one when the model is the default."""
    if not spec.speculative:
        return None
    if spec.drafter:
        return spec.drafter
    shipped = shipped_drafter_for(session.config.model)
    return str(shipped) if shipped else None


def build_decoder(spec: DecoderSpec, session: Session, drafters: dict[tuple[str, str], Eagle3Drafter] | None = None,
                  log: Callable[[str], None] | None = None) -> Decoder:
    """The decoder for ``spec``; the baseline when speculation is off or no drafter applies.
    ``drafters`` caches loaded drafters by path and weight format (several configurations share one); ``log``
    hears when the shape's costs are being measured."""
    path = resolve_drafter_path(spec, session)
    if path is None:
        return Decoder(BaselineDecoder(runner=session.runner), "baseline")
    drafters = {} if drafters is None else drafters
    weights = resolve_drafter_weights(spec.drafter_weights, session.config.weights, session.config.dtype,
                                      session.device).weights
    if (path, weights) not in drafters:
        drafters[path, weights] = load_session_drafter(session, path, weights, spec.aux_layer_convention)
    drafter = drafters[path, weights]
    choice = choose_spec(spec.config, session, drafter, None if path == RANDOM_DRAFTER else path, log,
                         defer=spec.defer_costs)
    if choice.plain_is_faster and spec.allow_plain:
        return Decoder(BaselineDecoder(runner=session.runner),
                       "baseline (auto: no speculative shape is predicted faster here)", choice=choice)
    c = replace(choice.config, ngram=spec.ngram)
    fmt = "" if weights == "native" else f" in {weights}"  # the drafter's format where it is not as loaded
    desc = (f"eagle3 (drafter {path}{fmt}, steps={c.num_steps}, topk={c.topk}, draft_tokens={c.num_draft_tokens}"
            + (f", ngram={c.ngram})" if c.ngram else ")"))
    adapt = choice.adaptive() if spec.adapt else None
    notes = []
    if adapt is not None:
        desc = desc[:-1] + ", adaptive)"
    elif spec.adapt:
        notes.append(f"--adapt needs a shape chosen by --spec-config auto (this one: {choice.how}, {choice.reason}); "
                     "the shape stays fixed")
    budget = None
    if spec.verify_budget:
        costs = choice.costs or cycle_costs(session, drafter, path, log)[0]
        shape = costs.shape_cost(replace(c, ngram=0))
        rest = (shape.draft_ms + shape.other_ms if shape is not None else 0.0) + costs.extend_ms(2)
        budget = VerifyBudget(costs.verify_ms, rest)
        desc = desc[:-1] + ", verify budget)"
    decoder = Eagle3Decoder(drafter, c, sync=spec.sync, comm=session.comm, adapt=adapt, runner=session.runner,
                            budget=budget)
    return Decoder(decoder, desc, path, c, choice, notes, weights)


def load_session_drafter(session: Session, path: str, weights: str = AUTO,
                         convention: Convention | None = None) -> Eagle3Drafter:
    """The drafter at ``path`` (or ``RANDOM_DRAFTER``) for this session's target: its linear layers in
    ``weights`` (auto: ``runtime.autoformat.resolve_drafter_weights``), activations as the target's, and
    kernels measured on its own shapes, as the target's were."""
    model = session.loaded.model
    weights = resolve_drafter_weights(weights, session.config.weights, session.config.dtype, session.device).weights
    if path == RANDOM_DRAFTER:
        drafter = random_drafter(model, min(RANDOM_DRAFT_VOCAB, model.config.vocab_size), seed=0)
    else:
        drafter = load_drafter(Path(path), model, convention=convention)
    if quantize_linears(drafter, weights):
        set_activations(drafter, session.config.activations)
    install_kernels(drafter, session.config.kernels, session.threads, session.device)
    return drafter
