"""Weight formats, one record each: what a format needs of the model file and the run (device,
tensor parallelism), how it is applied to a loaded model, and when ``--weights auto`` may choose
it. ``runtime.session`` applies the record asked for; ``runtime.autoformat`` asks the records
why not before choosing; nothing else branches on a format's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.core import quant
from specdecode.io.gguf import apply_gguf_q4, q4_layer_count


@dataclass(frozen=True)
class WeightFormat:
    name: str
    summary: str  # in words, for help and reports
    apply: Callable[[nn.Module, Path, torch.dtype], int]  # to the loaded (and sharded) model; layers changed
    gguf_only: bool = False  # needs a GGUF file's own blocks
    tensor_parallel: bool = False  # has a sharded path
    auto_devices: tuple[str, ...] = ("cpu", "cuda")  # device types where ``auto`` may choose it (its kernels are fast)
    native_kernels: bool = False  # on CPU its fast kernel is one of ours, built at first use (runtime.native)
    quantized: bool = True  # integer layers, whose activations are quantized as --activations says

    def refusal(self, source: Path | None, world_size: int) -> str | None:
        """Why this format cannot run ``source`` (None: not known yet) in this run (an explicit
        ``--weights`` is refused with it, naming the fix), or None."""
        if world_size > 1 and not self.tensor_parallel:
            return f"--weights {self.name} with tensor parallelism is not supported; drop one of them"
        if self.gguf_only and source is not None and source.suffix.lower() != ".gguf":
            return (f"--weights {self.name} runs a GGUF file's own 4-bit blocks; {source} is not a GGUF file "
                    "(use --weights int8)")
        return None


def _native(model: nn.Module, source: Path, dtype: torch.dtype) -> int:
    return 0


def _int8(model: nn.Module, source: Path, dtype: torch.dtype) -> int:
    return quant.quantize_weights(model, "int8")


def _q4(model: nn.Module, source: Path, dtype: torch.dtype) -> int:
    changed = apply_gguf_q4(model, source, dtype)
    if changed == 0:
        raise ValueError(f"--weights q4: {source} has no Q4_0/Q4_1 layer tensors (use --weights int8)")
    return changed + quant.quantize_weights(model, "q4")  # the layers left (a Q8_0 lm_head): int8


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("native", "the file's weights in the compute dtype", _native, tensor_parallel=True, quantized=False),
    WeightFormat("int8", "weight-only int8 per output channel (any source)", _int8),
    WeightFormat("q4", "a GGUF's own Q4_0/Q4_1 blocks, the other layers int8", _q4, gguf_only=True,
                 auto_devices=("cpu",), native_kernels=True),
)}
WEIGHT_FORMATS: tuple[str, ...] = tuple(FORMATS)
if set(WEIGHT_FORMATS) != set(quant.WEIGHT_FORMATS):  # the kernels' own list (core cannot import this one)
    raise ImportError(f"weight format records {WEIGHT_FORMATS} and core.quant's formats {quant.WEIGHT_FORMATS} differ")


def weight_format(name: str) -> WeightFormat:
    """The record of ``name``; an unknown name is refused, naming the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    return FORMATS[name]


def q4_unavailable(source: Path, dtype: str, device: torch.device, world_size: int) -> str | None:
    """Why ``--weights auto`` does not choose the GGUF's 4-bit blocks here, or None when it does."""
    q4 = FORMATS["q4"]
    if source.suffix.lower() != ".gguf":
        return "not a GGUF file (its 4-bit blocks are what q4 runs)"
    if dtype not in ("bfloat16", "bf16"):
        return f"{dtype} compute (no fast bf16 here) with the file's weights as they are"
    if device.type not in q4.auto_devices:
        return f"the 4-bit kernel is fast on {', '.join(q4.auto_devices)} only (device {device})"
    if world_size > 1 and not q4.tensor_parallel:
        return f"tensor parallelism ({world_size} ranks) has no 4-bit path"
    if q4_layer_count(source) == 0:
        return "the GGUF has no Q4_0/Q4_1 layers"
    return None
