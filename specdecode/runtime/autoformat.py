"""The default format: ``--dtype auto`` and ``--weights auto`` (the defaults of every command but
``check``, and of ``RuntimeConfig()``) are decided here and nowhere else.

The rule: bf16 compute where the device has fast bf16, and on a CPU the GGUF's own 4-bit blocks
where the file holds them (decoding is bound by the weights' bytes); native weights otherwise. The
measurements and every case: docs/defaults.md.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from specdecode.runtime.weights import q4_unavailable

AUTO = "auto"


@dataclass(frozen=True)
class FormatChoice:
    dtype: str
    weights: str
    reason: str  # why, in one line: shown at startup and recorded with results


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def machine_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (``/proc/cpuinfo``; empty where it has none)."""
    return _cpu_flags()


def fast_bf16(device: torch.device, cpu_flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and the evidence, in words."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bf16"
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if found:
        return True, f"the CPU has {', '.join(found)}"
    return False, f"the CPU ({platform.machine()}) has no bf16 instructions (avx512_bf16, amx_bf16 or bf16)"


# The drafter's weight format where ``--drafter-weights auto`` quantizes it (a CPU, bf16, a target in integer
# kernels): chosen by measurement, the cheapest format whose acceptance stays within 0.02 of bf16's
# (benchmarks/results/2026-12-07-cycle/, docs/defaults.md)
DEFAULT_DRAFTER_WEIGHTS = "int8"


def resolve_drafter_weights(asked: str, target_weights: str, dtype: str, device: torch.device) -> FormatChoice:
    """The drafter's weight format (``core.quant.DRAFTER_WEIGHT_FORMATS``) for ``--drafter-weights asked``: auto
    quantizes it where the target itself runs integer kernels on a CPU in bf16. There each draft call streams
    the head's weights from memory again (the target's step evicts them from the cache), so bytes are its
    cost; a GPU, float32 or a native target keeps the drafter as loaded."""
    if asked != AUTO:
        return FormatChoice(dtype, asked, "as asked")
    if device.type != "cpu":
        return FormatChoice(dtype, "native", f"{device.type}: the drafter as loaded")
    if target_weights == "native" or dtype != "bfloat16":
        return FormatChoice(dtype, "native", f"the target runs {dtype} {target_weights} weights: the drafter as loaded")
    return FormatChoice(dtype, DEFAULT_DRAFTER_WEIGHTS,
                        f"the target runs {target_weights} integer kernels on a CPU: the drafter's layers too "
                        f"({DEFAULT_DRAFTER_WEIGHTS}, the cheapest format measured within 0.02 of bf16's acceptance)")


def resolve_format(dtype: str, weights: str, source: Path, device: torch.device, world_size: int = 1,
                   cpu_flags: frozenset[str] | None = None) -> FormatChoice:
    """The (dtype, weights) to run ``source`` in; ``auto`` fields are chosen (see the module doc)."""
    if dtype != AUTO and weights != AUTO:
        return FormatChoice(dtype, weights, "as asked")
    reasons = []
    dtype_asked = dtype != AUTO
    if dtype == AUTO:
        ok, why = fast_bf16(device, cpu_flags)
        if not ok and weights in (AUTO, "q4") and q4_unavailable(source, "bfloat16", device, world_size) is None:
            ok, why = True, f"{why}, but the GGUF's 4-bit blocks run with bf16 activations and decoding is bound " \
                            "by the weights' bytes (docs/defaults.md)"
        dtype = "bfloat16" if ok else "float32"
        reasons.append(f"{dtype}: {why}")
    if weights == AUTO and dtype_asked:
        weights, why = "native", f"--dtype {dtype} given (add --weights q4 or int8 for reduced weights)"
        reasons.append(f"{weights} weights: {why}")
    elif weights == AUTO:
        weights, why = _weights(dtype, source, device, world_size)
        reasons.append(f"{weights} weights: {why}")
    return FormatChoice(dtype, weights, "; ".join(reasons))


def _weights(dtype: str, source: Path, device: torch.device, world_size: int) -> tuple[str, str]:
    why_not = q4_unavailable(source, dtype, device, world_size)
    if why_not is not None:
        return "native", why_not
    return "q4", "the GGUF's own 4-bit blocks: the fewest bytes a step reads (benchmarks/results/engine/)"
