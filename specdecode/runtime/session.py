"""One setup for every command that runs the model: threads, device, dtype, the loaded model
and, when this process is one rank of a tensor-parallel group, its shard. ``generate``,
``bench``, ``sweep``, ``check``, ``serve``, ``data build`` and the trainer's evaluation all
start here, so they cannot set up differently."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from specdecode.core.compiled import CompiledRunner, GraphKey
from specdecode.core.kernels import KernelPlan
from specdecode.core.quant import DEFAULT_ACTIVATIONS, activation_bits, set_activations
from specdecode.core.runner import EAGER, StepRunner
from specdecode.io.loading import LoadedModel, load_model, parse_dtype, resolve_model_dir
from specdecode.io.paths import check_cache_writable, is_default_model
from specdecode.runtime.autoformat import AUTO, resolve_format
from specdecode.runtime.compiling import compiled_runner, graph_store, resolve_compile, stored_steps
from specdecode.runtime.device import configure_threads, resolve_device
from specdecode.runtime.distributed import world
from specdecode.runtime.graphstore import inductor_cache_dir
from specdecode.runtime.kernels import check_kernel_mode, install_kernels
from specdecode.runtime.native import load_native
from specdecode.runtime.sharding import CommMeter, apply_tensor_parallel
from specdecode.runtime.weights import weight_format

T = TypeVar("T")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the target runs. ``model=None`` is the default SmolLM2-135M-Instruct GGUF;
    ``dtype`` and ``weights`` ``auto`` are chosen by ``runtime.autoformat`` (the session's config
    holds the resolved values, ``Session.format_reason`` why)."""

    model: str | None = None
    dtype: str = AUTO  # float32 | bfloat16 | auto
    device: str = "cpu"
    threads: int | None = None  # None: $SPECDECODE_THREADS, else $OMP_NUM_THREADS, else the cores available
    weights: str = AUTO  # runtime.weights.WEIGHT_FORMATS (native, int8, q4) or auto
    kernels: str = "auto"  # core.kernels.KERNEL_MODES: auto (measured per shape and row count, cached) or static
    # core.quant.ACTIVATIONS: how int8 and 4-bit layers quantize activations where they run the row-invariant
    # integer kernels (int8 or int16 per block of 32)
    activations: str = DEFAULT_ACTIVATIONS
    compile: str = "auto"  # core.compiled.COMPILE_MODES: decode/verify steps compiled (runtime.compiling)
    long_running: bool = False  # data build: what --compile auto compiles for (at first use)
    # --compile auto runs the graphs stored for this machine (`specdecode compile`, or a run's background build:
    # runtime.builds), other shapes eager; False (bench, sweep, check: what they are told): eager
    stored_graphs: bool = True

    @property
    def is_default_model(self) -> bool:
        return is_default_model(self.model)


@dataclass
class Session:
    config: RuntimeConfig
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    threads: int
    rank: int = 0
    world_size: int = 1
    comm: CommMeter | None = None  # this rank's all-reduce meter under tensor parallelism
    kernels: KernelPlan = field(default_factory=KernelPlan)  # the linear kernels installed (runtime.kernels)
    format_reason: str = "as asked"  # why this dtype and weight format (runtime.autoformat)
    compiled: CompiledRunner | None = None  # the runner of compiled steps when --compile is on (or graphs are stored)
    compile_reason: str = "off: as asked"  # why they are (runtime.compiling.resolve_compile)
    on_compile: Callable[[GraphKey, float | None], None] | None = None  # hears every graph compiled

    @property
    def runner(self) -> StepRunner:
        """How this session's decoders run their steps: compiled, or eager."""
        return self.compiled if self.compiled is not None else EAGER

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def building_steps(self) -> CompiledRunner:
        """The compiled steps, made (not installed) when this session runs eager: a bench method with
        ``compile=on`` beside an eager one, in one run."""
        if self.compiled is None or not self.compiled.build:
            inductor_cache_dir()
            self.compiled = CompiledRunner(self.device.type, on_compile=self.on_compile, store=graph_store(self.device))
        return self.compiled

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that prints and stores results."""
        return self.rank == 0


def on_passing_thread(fn: Callable[[], T], device: str = "cpu") -> T:
    """``fn()`` on a thread that ends when it returns (its exception propagates); on a non-CPU
    ``device`` it runs here instead (CUDA's current device is per thread).

    For a process whose model runs on a thread other than the one that loaded it (the server:
    the event loop on the main thread, generation on a worker). Torch's OpenMP runtime on CPU
    (libgomp) keeps a team of spinning worker threads for every thread that ran a parallel op,
    and once it manages more threads than there are cores it throttles their spin-waiting,
    for every team: each parallel region then waits on a futex wake-up, and a token took about a third
    longer when the model was loaded on the main thread (docs/LOG.md). A team ends with its thread,
    so loading here leaves the decoding thread the only team."""
    if resolve_device(device).type != "cpu":
        return fn()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-load") as pool:
        return pool.submit(fn).result()


def start(config: RuntimeConfig, on_compile: Callable[[GraphKey, float | None], None] | None = None,
          log: Callable[[str], None] | None = None) -> Session:
    """Configure threads and device, load the model, shard it if a process group exists, put
    its weights in the asked format, install its linear kernels (measured once per machine) and,
    where ``config.compile`` resolves on, its compiled steps (``on_compile`` hears each graph's
    compilation: (key, None) before, (key, seconds) after)."""
    check_cache_writable()
    threads = configure_threads(config.threads)
    device = resolve_device(config.device)
    if config.weights != AUTO:
        weight_format(config.weights)  # an unknown name: refused before the model loads
    if config.dtype != AUTO:
        parse_dtype(config.dtype)
    check_kernel_mode(config.kernels)
    activation_bits(config.activations)
    rank, size = world()
    use_compiled, compile_reason = resolve_compile(config.compile, config.long_running, size)
    if size > 1 and config.weights != AUTO and (refusal := weight_format(config.weights).refusal(None, size)):
        raise ValueError(refusal)  # before resolving the model
    source, _ = resolve_model_dir(config.model)
    chosen = resolve_format(config.dtype, config.weights, source, device, size)
    config = replace(config, dtype=chosen.dtype, weights=chosen.weights)
    dtype = parse_dtype(config.dtype)
    fmt = weight_format(config.weights)
    if (refusal := fmt.refusal(source, size)) is not None:
        raise ValueError(refusal)
    loaded = load_model(config.model, dtype, device)
    comm = apply_tensor_parallel(loaded.model, rank, size) if size > 1 else None
    fmt.apply(loaded.model, loaded.source, dtype)
    set_activations(loaded.model, config.activations)
    if device.type == "cpu" and fmt.native_kernels:
        load_native(log)  # its 4-bit kernel joins the kernel plan's candidates (runtime.native)
    plan = install_kernels(loaded.model, config.kernels, threads, device, log)  # ``log`` hears a long measurement
    compiled = compiled_runner(device, on_compile, graph_store(device, log)) if use_compiled else None
    if compiled is None and config.compile == AUTO and config.stored_graphs and size == 1:
        compiled, compile_reason = stored_steps(loaded.model, device, on_compile, log)
    return Session(config, loaded, device, dtype, threads, rank, size, comm, plan, chosen.reason, compiled,
                   compile_reason, on_compile)
