"""Linear-layer kernels, chosen per weight shape and row count by measurement.

Decoding streams every weight once per step, so the matmul kernel sets the step time, and no kernel
wins at every shape and row count (bf16 `F.linear` against oneDNN with the weight packed once, int8 and
4-bit kernels). So ``choose_kernels`` times every candidate of each weight shape on the model's own
weights at the row counts of ``ROW_BUCKETS``, once, and ``apply_kernels`` installs the choice
(``runtime.kernels`` caches it on disk). Every kernel of a layer computes the same formula.

The measurements behind this, per kernel and shape: docs/LOG.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Row counts a plan distinguishes: a call with r rows uses the choice measured at the first
# bucket >= r (the last one beyond): decode (1), verify trees and batches (2-64), prefill chunks.
ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 256)
KERNEL_MODES = ("auto", "static")

# oneDNN packs for an expected row count; this hint was fp32's best at every row count tried when it was set
# (docs/LOG.md, kernel plans), and bf16 ignores it (see the module docstring).
_ONEDNN_BATCH_HINT = 64
_ONEDNN_DTYPES = (torch.bfloat16, torch.float32)
ONEDNN_F32 = "onednn_f32"  # a bf16 layer's weight kept in fp32, packed for oneDNN (see the module docstring)
PACKED_KERNELS = ("onednn", ONEDNN_F32)  # kernels that run a packed copy of the weight


def native_loaded(op: str = "q4_linear") -> bool:
    """Whether the project's CPU operator ``op`` is registered (``runtime.native.load_native``)."""
    try:
        return hasattr(torch.ops.specdecode, op)
    except (AttributeError, RuntimeError):
        return False


def bucket_of(rows: int) -> int:
    """Index into ROW_BUCKETS of the choice that serves ``rows`` rows."""
    # a loop, not bisect: compiled steps trace through it (dynamo cannot trace C's bisect)
    for i, bound in enumerate(ROW_BUCKETS):
        if rows <= bound:
            return i
    return len(ROW_BUCKETS) - 1


def onednn_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` here. Its bf16 path needs AVX-512 (bw, vl, dq)
    or avx_ne_convert: on an AVX2-only CPU (an AMD EPYC Zen 3 seen here) packing a bf16 weight
    raises, so bf16 offers no oneDNN candidate there (aten's bf16 matmul still runs)."""
    if device.type != "cpu" or dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return dtype != torch.bfloat16 or _onednn_bf16()


def onednn_f32_offered(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer computing in ``dtype`` offers ``onednn_f32``: bf16 where oneDNN runs fp32 but not
    bf16 (there aten's bf16 GEMM and the 4-bit kernel are what is left, both slow at many rows)."""
    return dtype == torch.bfloat16 and onednn_usable(torch.float32, device) and not onednn_usable(dtype, device)


def onednn_f32_linear(x2: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``onednn_f32``: x2 (bf16) in fp32 through the fp32-packed weight, the result back in x2's dtype."""
    return onednn_linear(x2.float(), packed, None if bias is None else bias.float()).to(x2.dtype)


@cache
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_pack(weight: Tensor) -> Tensor:
    """The weight [out, in] in oneDNN's blocked layout (an opaque tensor, for onednn_linear)."""
    return cast(Tensor, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ONEDNN_BATCH_HINT))


def onednn_linear(x2: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return cast(Tensor, torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], ""))


class KernelLayer(Protocol):
    """A linear layer with several kernels for one formula (``core.model.Linear``,
    ``core.quant.Int8Linear``)."""

    kernels: tuple[str, ...] | None  # one kernel per ROW_BUCKETS entry; None: the static rule
    packed: Tensor | None  # the oneDNN-packed weight when a chosen kernel needs it

    def group_key(self) -> str: ...
    def kernel_candidates(self, rows: int) -> tuple[str, ...]: ...
    def packable_weight(self, kernel: str = "onednn") -> Tensor: ...  # the weight as ``kernel`` packs it
    def run_kernel(self, kernel: str, x2: Tensor) -> Tensor: ...


def kernel_layers(model: nn.Module) -> dict[str, list[KernelLayer]]:
    """The model's kernel layers grouped by shape, dtype and kind (a group shares one choice)."""
    groups: dict[str, list[KernelLayer]] = {}
    for m in model.modules():
        if hasattr(m, "kernel_candidates"):
            layer = cast(KernelLayer, m)
            groups.setdefault(layer.group_key(), []).append(layer)
    return groups


@dataclass
class KernelPlan:
    """Which kernel each group runs at each ROW_BUCKETS entry, and how it was decided."""

    mode: str = "static"  # KERNEL_MODES
    source: str = "static"  # measured | cached | static
    choices: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0  # measuring time (0 when cached or static)

    def summary(self) -> dict[str, object]:
        """For fingerprints: the mode, where the choice came from and the choice itself."""
        return {"mode": self.mode, "source": self.source, "choices": self.choices}


# In the plan's cache key: plans measured otherwise are measured again.
MEASURE_METHOD = "interleaved"


def _time_kernels(layers: list[KernelLayer], kernels: Sequence[str], x: Tensor, reps: int) -> dict[str, float]:
    """Best of ``reps`` passes per kernel, each calling it once on every layer, the kernels alternated pass
    by pass (reversed every other round), so a burst of load on a shared machine slows every candidate
    rather than the one timed during it (one kernel's passes after another's, a plan measured beside a
    training run kept onednn at 8 rows). One warm-up pass first: oneDNN creates its primitive on the first
    call of a shape.

    The passes run hot in cache, as in a plan measured alone. Flushing the caches before each pass (64 MB
    read) looked closer to a decode step, where ~105 MB of other weights pass between two calls of a
    group, but chose worse: on the Zen4 EPYC it took int4pack for three of the four 4-bit groups at 1 row,
    and the eager forward was slower than with the hot plan at 1 and 4 tokens
    (``benchmarks/results/kernel-plan/``)."""
    best = dict.fromkeys(kernels, float("inf"))
    for i in range(reps + 1):
        for kernel in (kernels if i % 2 else list(reversed(kernels))):
            t = time.perf_counter()
            for layer in layers:
                layer.run_kernel(kernel, x)
            if i:
                best[kernel] = min(best[kernel], time.perf_counter() - t)
    return best


def offered(layer: KernelLayer, rows: int, exclude: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The layer's kernel candidates at ``rows`` rows but the excluded ones."""
    return tuple(k for k in layer.kernel_candidates(rows) if k not in exclude)


def pack(layer: KernelLayer, kernels: Sequence[str]) -> None:
    """Give the layer the packed weight its ``kernels`` need (at most one packed kernel per layer)."""
    needed = [k for k in PACKED_KERNELS if k in kernels]
    if len(needed) > 1:
        raise ValueError(f"one packed weight per layer; {needed} would need two")
    layer.packed = onednn_pack(layer.packable_weight(needed[0])) if needed else None


def choose_kernels(model: nn.Module, reps: int = 3,
                   on_group: Callable[[int, int, str], None] | None = None,
                   known: dict[str, list[str]] | None = None,
                   on_choice: Callable[[str, list[str]], None] | None = None,
                   exclude: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """Time every candidate kernel of each group at each ROW_BUCKETS row count, calling it
    once per layer of the group (so the weights stream from memory as in a decode step), and
    return the fastest per group and bucket. Groups with a single candidate are left out.
    ``on_group(done, total, key)`` hears each group as it starts (progress for a long measurement);
    ``on_choice(key, picked)`` each group's choice as it is made (a plan saved as it goes), and groups
    in ``known`` (such a partial plan) are taken as they are, not measured again. Kernels in ``exclude``
    are not tried (``runtime.kernels``: an fp32 copy that would not fit in memory)."""
    choices: dict[str, list[str]] = {}
    groups = []
    for key, layers in kernel_layers(model).items():
        if max(len(offered(layers[0], rows, exclude)) for rows in ROW_BUCKETS) < 2:
            continue
        if known and key in known:
            choices[key] = list(known[key])
        else:
            groups.append((key, layers))
    with torch.inference_mode():
        for done, (key, layers) in enumerate(groups):
            if on_group is not None:
                on_group(done, len(groups), key)
            for layer in layers:
                pack(layer, offered(layer, 1, exclude))
            w = layers[0].packable_weight()  # the layer's own dtype: its activations'
            picked = []
            for rows in ROW_BUCKETS:
                x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
                times = _time_kernels(layers, offered(layers[0], rows, exclude), x, reps)
                picked.append(min(times, key=times.__getitem__))
            choices[key] = picked
            for layer in layers:
                layer.packed = None
            if on_choice is not None:
                on_choice(key, picked)
    return choices


def apply_kernels(model: nn.Module, choices: dict[str, list[str]]) -> int:
    """Install ``choices`` (from choose_kernels) on the model's layers; groups not in it keep
    their static rule. Returns how many layers got a plan. A plan for another row-bucket
    layout or with a kernel a layer does not offer is refused (a stale cache)."""
    count = 0
    for key, layers in kernel_layers(model).items():
        for layer in layers:
            layer.kernels, layer.packed = None, None
        picked = choices.get(key)
        if picked is None:
            continue
        known = {k for rows in ROW_BUCKETS for k in layers[0].kernel_candidates(rows)}
        if len(picked) != len(ROW_BUCKETS) or not set(picked) <= known:
            raise ValueError(f"kernel plan for {key} ({picked}) does not fit this build: {len(ROW_BUCKETS)} row "
                             f"buckets, kernels {sorted(known)}; measure again (--kernels auto with a fresh cache)")
        for layer in layers:
            layer.kernels = tuple(picked)
            pack(layer, picked)
            count += 1
    return count


class KernelDispatch:
    """What every kernel layer (``Linear``, ``core.quant.Int8Linear``, ``Int4Linear``) shares: the
    row count picks the plan's kernel (``kernels``, per ROW_BUCKETS) where the plan applies to the
    input, else the layer's static rule; ``run_kernel`` computes. Under ``torch.compile`` the oneDNN
    choice runs as ``aten``: inductor's freezing packs (and folds a dequantised) weight itself, and
    oneDNN's packed weight is an opaque tensor dynamo cannot trace."""

    kernels: tuple[str, ...] | None = None  # one kernel per ROW_BUCKETS entry; None: the static rule
    packed: Tensor | None = None  # the oneDNN-packed weight when a chosen kernel needs it (apply_kernels)
    out_features: int

    def plan_applies(self, x: Tensor) -> bool:
        raise NotImplementedError

    def static_kernel(self, rows: int, x: Tensor) -> str:
        raise NotImplementedError

    def run_kernel(self, kernel: str, x2: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, x.shape[-1])
        kernel = (self.kernels[bucket_of(rows)] if self.kernels is not None and self.plan_applies(x)
                  else self.static_kernel(rows, x))
        if kernel in PACKED_KERNELS and torch.compiler.is_compiling():  # asked only then: ~300 calls a step
            kernel = self.graph_kernel(rows, x, kernel)
        return self.run_kernel(kernel, x2).view(*x.shape[:-1], self.out_features)

    def graph_kernel(self, rows: int, x: Tensor, kernel: str) -> str:
        """What a compiled graph runs where the plan chose a packed kernel (an opaque weight, not traced):
        ``onednn`` becomes ``aten`` (inductor's freezing packs the constant weight for oneDNN itself),
        ``onednn_f32`` the layer's own rule."""
        return "aten" if kernel == "onednn" else self.static_kernel(rows, x)

    # Calling runs forward directly, without nn.Module's hook dispatch: a decode step makes about
    # 300 such calls (skipping it saved about 5% of a step). Hooks on these inner modules do not fire;
    # hook the Transformer itself.
    __call__ = forward


# Up to this many rows, fp32 CPU matmuls go through a GEMM with the weight as the
# left operand (W @ x^T). Measured here on 2 threads: 40-49 GB/s for 1-4 rows against
# 8-20 GB/s for F.linear (x @ W^T), whose small-batch path is a slow GEMV; from about
# 12 rows on both are equal. One row is padded to two because a single column falls
# back to the slow GEMV again. bf16 is the other way round, so it keeps F.linear.
_WEIGHT_LEFT_MAX_ROWS = 8


class Linear(KernelDispatch, nn.Linear):
    """nn.Linear with a choice of kernels: ``aten`` (F.linear), ``weight_left`` (the fast fp32
    small-batch path above) and ``onednn`` (the weight packed once). Same parameters, same
    results up to float summation order."""

    def plan_applies(self, x: Tensor) -> bool:
        w = self.weight
        return x.dtype == w.dtype and not (w.requires_grad and torch.is_grad_enabled())  # packed copies do not train

    def static_kernel(self, rows: int, x: Tensor) -> str:
        w = self.weight
        return "weight_left" if rows <= _WEIGHT_LEFT_MAX_ROWS and w.dtype == torch.float32 and w.device.type == "cpu" \
            else "aten"

    def run_kernel(self, kernel: str, x2: Tensor) -> Tensor:
        """y = x2 @ W^T + b for x2 [rows, in] with the named kernel."""
        w = self.weight
        if kernel == "onednn" and self.packed is not None:
            return onednn_linear(x2, self.packed, self.bias)
        if kernel == ONEDNN_F32 and self.packed is not None:
            return onednn_f32_linear(x2, self.packed, self.bias)
        if kernel == "weight_left":
            rows = x2.shape[0]
            if rows == 1:
                x2 = x2.expand(2, -1)
            out = torch.mm(w, x2.contiguous().t())[:, :rows].t().contiguous()
            return out if self.bias is None else out + self.bias
        return F.linear(x2, w, self.bias)

    def group_key(self) -> str:
        return f"linear:{self.out_features}x{self.in_features}:{str(self.weight.dtype).removeprefix('torch.')}"

    def kernel_candidates(self, rows: int) -> tuple[str, ...]:
        w = self.weight
        found = ["aten"]
        if w.dtype == torch.float32 and w.device.type == "cpu" and rows <= _WEIGHT_LEFT_MAX_ROWS:
            found.append("weight_left")
        if onednn_usable(w.dtype, w.device):
            found.append("onednn")
        if onednn_f32_offered(w.dtype, w.device):
            found.append(ONEDNN_F32)
        return tuple(found)

    def packable_weight(self, kernel: str = "onednn") -> Tensor:
        return self.weight.detach().float() if kernel == ONEDNN_F32 else self.weight.detach()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that overrides forward (RowParallelLinear) is called through its own."""
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward  # type: ignore[method-assign]
