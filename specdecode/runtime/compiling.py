"""Whether the target's decode and verify steps run compiled (``core.compiled``), and setting it up.

``--compile auto`` (the default) compiles for the jobs that run for hours (``serve``, ``data
build``: ``RuntimeConfig.long_running``): a graph costs about 70-110 s cold on a 2-core CPU (17-25 s
from inductor's on-disk cache) and saves about 10 ms per step there, so it pays back after some
thousands of steps. ``generate`` stays eager under ``auto`` (even a cached graph's start costs more
than it saves over a few hundred tokens), and so do ``bench`` and ``sweep``, which measure what they
are told (``--compile on``, or a method's ``compile=on``: a short bench would time the compiler).

Measured again on a 2-core AVX2-only EPYC by an ad-hoc script, not a shipped benchmark (bf16 + q4,
plain decoding, 64 tokens, interleaved): the
compiled decode 32.3 tok/s against 23.8 eager, one graph 202 s cold and 33.6 s from the cache, so
``generate`` breaks even after about 3000 tokens. The cache saves only inductor's code generation:
a profiled warm start spent 16 s in dynamo's tracing, 14 s in AOT autograd's, 15 s in freezing's
passes and 6 s in joint-graph passes, against 4.6 s loading the cached kernels. AOT autograd's own
cache refuses frozen graphs ("Cannot cache a graph with freezing enabled"), and freezing is what
makes the CPU graph faster than eager. A fast warm start needs graphs persisted whole: a prototype
on a tiny float32 model (``torch.export`` of ``Transformer.step``, the cache lists as inputs, then
``aoti_compile_and_package`` with freezing) loaded in 0.01 s, wrote the cache in place at its slot
and matched eager within 1e-5; each package embeds its own (frozen) weights (issue 22).
Tensor parallelism stays eager (its all-reduce sits inside every layer). ``on``/``off`` decide.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specdecode.core.compiled import CompiledSteps, GraphKey, check_compile_mode
from specdecode.core.model import Transformer
from specdecode.io.paths import cache_root

if TYPE_CHECKING:
    from specdecode.runtime.session import Session


def resolve_compile(mode: str, long_running: bool, world_size: int) -> tuple[bool, str]:
    """(compile?, why) for ``--compile MODE``."""
    check_compile_mode(mode)
    if world_size > 1:
        if mode == "on":
            raise ValueError("--compile on with tensor parallelism is not supported (the all-reduce inside every "
                             "layer); use --compile off or --tp 1")
        return False, f"eager: tensor parallelism ({world_size} ranks)"
    if mode != "auto":
        return mode == "on", f"{mode}: as asked"
    if long_running:
        return True, "auto: a long-running job (graphs compile on first use, cached on disk)"
    return False, "auto: a single generation stays eager (a compiled graph's start costs more than it saves)"


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache under ours ($SPECDECODE_CACHE/inductor) unless the user set one."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def install_compiled(model: Transformer, device: torch.device,
                     on_compile: Callable[[GraphKey, float | None], None] | None = None) -> CompiledSteps:
    """Compiled steps on ``model`` (``model.steps``); graphs compile at first use."""
    inductor_cache_dir()
    steps = CompiledSteps(device.type, on_compile=on_compile)
    model.steps = steps
    return steps


def compiled_steps(session: Session) -> CompiledSteps:
    """The session's compiled steps, made (not installed) when it runs eager: a bench method with
    ``compile=on`` beside an eager one, in one run."""
    if session.compiled is None:
        inductor_cache_dir()
        session.compiled = CompiledSteps(session.device.type, on_compile=session.on_compile)
    return session.compiled
