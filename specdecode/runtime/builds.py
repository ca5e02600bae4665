"""When a run builds the compiled graphs it ran eager, and with which flags: after ``generate``'s run, at a
server's start, or when a library user asks (``build_missing``). The build is ``specdecode compile`` with
the run's own settings, detached at the lowest priority (``runtime.background``); its graphs land whole,
and the next start loads them. More in docs/compiled.md."""

from __future__ import annotations

import os

from specdecode.core.batching import DEFAULT_COMPILE_MAX_LEN, BatchConfig
from specdecode.core.costmodel import AutoSpec
from specdecode.core.quant import DEFAULT_ACTIVATIONS
from specdecode.core.speculative import SpecConfig
from specdecode.runtime.autoformat import AUTO
from specdecode.runtime.background import BACKGROUND_ENV, BackgroundBuild, build_in_background
from specdecode.runtime.decoders import DecoderSpec
from specdecode.runtime.graphstore import PackageStore
from specdecode.runtime.session import RuntimeConfig, Session


def compile_flags(runtime: RuntimeConfig, spec: DecoderSpec, shape: SpecConfig | None, max_len: int,
                  with_candidates: bool = False, serve: BatchConfig | None = None) -> list[str]:
    """The `specdecode compile` arguments that build the graphs of a run with these settings: the model and its
    format, the drafter, the speculative ``shape`` it decoded with (None: ``spec``'s own), every
    candidate shape's graphs too (``with_candidates``), and a server's batching (``serve``: `compile --serve`, then
    ``max_len`` is its --compile-max-len). What the CLI parses
    them into is this run's settings again (tested)."""
    out: list[str] = []

    def put(flag: str, value: object, default: object = None) -> None:
        if value is not None and value != default:
            out.extend([flag, str(value)])

    put("--model", runtime.model)
    put("--dtype", runtime.dtype, AUTO)
    put("--weights", runtime.weights, AUTO)
    put("--device", runtime.device, "cpu")
    put("--threads", runtime.threads)
    put("--kernels", runtime.kernels, "auto")
    put("--activations", runtime.activations, DEFAULT_ACTIVATIONS)
    if not spec.speculative:
        out.append("--no-spec")
    else:
        put("--drafter", spec.drafter)
        put("--aux-layer-convention", spec.aux_layer_convention)
        put("--drafter-weights", spec.drafter_weights, AUTO)
        put("--ngram", spec.ngram, 0)
        config = shape if shape is not None else spec.config
        if isinstance(config, SpecConfig) and shape is None:
            out.extend(["--spec-config", "static"])
        put("--num-steps", config.num_steps)
        put("--topk", config.topk)
        put("--num-draft-tokens", config.num_draft_tokens)
        if spec.adapt:
            out.append("--adapt")
        if with_candidates:
            out.append("--with-candidates")
    if serve is not None:
        b = serve
        out.append("--serve")
        put("--max-running-requests", b.slots)
        put("--context-length", b.slot_tokens)
        put("--chunked-prefill-size", b.prefill_chunk)
        put("--spec-policy", b.spec_policy)
        if b.batch_invariant:
            out.append("--batch-invariant")
    return [*out, "--compile-max-len", str(max_len)]


def builds_after(session: Session) -> bool:
    """Whether a run in this session builds its missing graphs in the background: ``--compile auto`` with stored
    graphs (``RuntimeConfig.stored_graphs``), one CPU process, $SPECDECODE_BACKGROUND_COMPILE not 0."""
    return (session.config.compile == AUTO and session.config.stored_graphs and session.device.type == "cpu"
            and session.world_size == 1 and os.environ.get(BACKGROUND_ENV, "1") != "0")


def build_missing(session: Session, spec: DecoderSpec, shape: SpecConfig | None, max_len: int,
                  serve: BatchConfig | None = None) -> BackgroundBuild | None:
    """Start `specdecode compile` in the background for the graphs this session's run had to run eager (the
    runner's eager shapes; every shape where none was stored), with the run's settings and the speculative
    ``shape`` it decoded with: named, not chosen again (auto's pick can change between calibrations, and a set
    built for another shape would leave this one eager). Where auto chose the shape, every candidate's graphs
    too, so that auto times each on graphs and may choose it. None: nothing to build (``builds_after``)."""
    if not builds_after(session):
        return None
    steps = session.compiled
    if steps is not None and not steps.eager:
        return None  # every shape ran on a stored graph
    root = steps.store.root if steps is not None and isinstance(steps.store, PackageStore) else PackageStore().root
    auto = serve is None and spec.speculative and isinstance(spec.config, AutoSpec) and not spec.config.complete
    if serve is None:
        max_len = max(max_len, DEFAULT_COMPILE_MAX_LEN)
    flags = compile_flags(session.config, spec, shape, max_len, auto, serve)
    return build_in_background(flags, root)
