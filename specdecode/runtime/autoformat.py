"""The default format: ``--dtype auto`` and ``--weights auto`` (the defaults of every command but
``check``, and of ``RuntimeConfig()``) are decided here and nowhere else.

The rule, from the engine tables in the README (2 threads, SmolLM2-135M Q4_1 GGUF): bf16 compute
with the GGUF's own 4-bit blocks decodes at 7.2 ms per step against 12.2 ms bf16 native and 18.3
ms fp32, at +0.18% held-out perplexity. So:

- compute dtype: bfloat16 where the device has fast bf16 (CUDA: ``torch.cuda.is_bf16_supported``;
  CPU: the ``avx512_bf16`` or ``amx_bf16`` flag on x86, ``bf16`` on Arm, read from
  ``/proc/cpuinfo``), else float32 (bf16 emulated in fp32 is slower than fp32 itself) -- except
  where the 4-bit blocks apply (below): they run with bf16 activations, and decoding is bound by
  the weights' bytes, not the arithmetic. Measured on an AVX2-only AMD EPYC (Zen 3, no bf16
  instructions, 2 threads, `formats` and `bench` on 13 Spec-Bench prompts x 64 tokens): decode
  step 42 ms bf16 + q4 against 110 ms fp32 native (103 ms fp32 + q4), baseline 20.2 against 9.2
  tok/s; its prefill was 1.2-1.7x slower (TTFT of a ~1800-token prompt 3.6 s against 2.1 s), which
  64 new tokens already paid back. Training, compute-bound, keeps fp32 there (``training.trainer``);
- weights: a GGUF's own 4-bit blocks (``q4``) when the file has Q4_0/Q4_1 layers, the device is
  a CPU (the 4-bit kernel is aten's CPU one), there is no tensor parallelism (no 4-bit sharded
  path) and the dtype is bf16 or not given; else the weights in the compute dtype (``native``).

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
                            "by the weights' bytes (an AVX2-only EPYC: 42 ms per step against 110 ms fp32)"
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
