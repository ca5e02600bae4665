"""The default format: ``--dtype auto`` and ``--weights auto`` (the defaults of every command but
``check``, and of ``RuntimeConfig()``) are decided here and nowhere else.

The rule, from the engine tables in the README (2 threads, SmolLM2-135M Q4_1 GGUF): bf16 compute
with the GGUF's own 4-bit blocks decodes at 7.2 ms per step against 12.2 ms bf16 native and 18.3
ms fp32, at +0.18% held-out perplexity. So:

- compute dtype: bfloat16 where the device has fast bf16 (CUDA: ``torch.cuda.is_bf16_supported``;
  CPU: the ``avx512_bf16`` or ``amx_bf16`` flag on x86, ``bf16`` on Arm, read from
  ``/proc/cpuinfo``), else float32 (bf16 emulated in fp32 is slower than fp32 itself);
- weights: a GGUF's own 4-bit blocks (``q4``) when the file has Q4_0/Q4_1 layers, the compute
  is bf16, the device is a CPU (the 4-bit kernel is aten's CPU one) and there is no tensor
  parallelism (no 4-bit sharded path); else the weights in the compute dtype (``native``).

An explicit ``--weights`` is kept and the dtype chosen around it. An explicit ``--dtype`` keeps
native weights (``--dtype bfloat16`` means what it always meant: bf16 native; ``--dtype float32``
the exact reference ``check`` is about); ``--weights q4`` asks for the 4-bit blocks.
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


def resolve_format(dtype: str, weights: str, source: Path, device: torch.device, world_size: int = 1,
                   cpu_flags: frozenset[str] | None = None) -> FormatChoice:
    """The (dtype, weights) to run ``source`` in; ``auto`` fields are chosen (see the module doc)."""
    if dtype != AUTO and weights != AUTO:
        return FormatChoice(dtype, weights, "as asked")
    reasons = []
    dtype_asked = dtype != AUTO
    if dtype == AUTO:
        ok, why = fast_bf16(device, cpu_flags)
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
    return "q4", "the GGUF's own 4-bit blocks (README: 7.2 ms per step vs 12.2 ms bf16 native, perplexity +0.18%)"
