"""Weight formats of the target model: ``native`` keeps every weight in the model's dtype;
``int8`` stores the weights of every linear layer (lm_head included) as int8 with one symmetric
scale per output channel, and computes in the model's dtype ("weight-only int8": torchao's
``int8wo``, vLLM's W8A16). The embedding table stays in the model dtype (a lookup reads one row).
``q4`` keeps the 4-bit blocks a GGUF file holds (Q4_0/Q4_1, 32 weights per block with their
own scale and offset; ``io.gguf.apply_gguf_q4``) and runs them with a 4-bit kernel
(:class:`Int4Linear`): no re-quantization, the weights are the file's; layers stored otherwise in
the file (SmolLM2's tied embedding/lm_head: Q8_0) take the int8 format.

More in docs/formats.md.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.core.kernels import (
    ONEDNN_F32,
    PACKED_KERNELS,
    KernelDispatch,
    bucket_of,
    onednn_f32_linear,
    onednn_f32_offered,
    onednn_linear,
    onednn_usable,
)
from specdecode.core.kernels import native_loaded as native_loaded  # where the kernel plan asks

WEIGHT_FORMATS = ("native", "int8", "q4")
# dtypes aten._weight_int8pack_mm takes on CPU; others (float64 in exactness tests) use the
# plain formula, which computes the same product
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The static rule (``--kernels static``; ``auto`` measures instead): up to this many rows the
# int8 kernel; beyond (prompt prefill, verify trees over 32 tokens) the
# int8 weight converted to the model dtype (exactly: |q| <= 127 fits any float's mantissa) and
# one GEMM, with the same per-channel scale applied to the output. The kernel's cost grows
# linearly with the rows, so convert+GEMM wins from about 32 rows (measured per layer shape in bf16: docs/LOG.md).
# Decode and the verify trees the engine uses (3-16 tokens) stay on the kernel.
_KERNEL_MAX_ROWS = 32
# The project's own kernels (core/csrc: activations in int16 per block of 32, exact to about 2^-15 of
# each block's largest value, well inside bf16's rounding but not float32's, so they are offered to bf16
# layers only), once ``runtime.native.load_native`` has registered them: kernel name -> operator.
# avx2_linear.cpp's run on any AVX2 + FMA CPU, avx512_linear.cpp's (the same arithmetic with VNNI) where
# the CPU has AVX-512 VNNI; the kernel plan measures them against aten's per shape and row count.
NATIVE_Q4 = "q4_avx2"  # specdecode::q4_linear
NATIVE_I8 = "i8_avx2"  # specdecode::i8_linear
NATIVE_Q4_KERNELS = {NATIVE_Q4: "q4_linear", "q4_avx512": "q4_linear_avx512"}
NATIVE_I8_KERNELS = {NATIVE_I8: "i8_linear", "i8_avx512": "i8_linear_avx512"}

# The row-invariant integer family (core/csrc/rows_linear.cpp, AVX-512 VNNI): a row's output is the same bits
# whether it runs alone, in a verify of k tokens or in a batch, because activations are quantized row by row
# and every block sums exactly in integers before a float epilogue in a fixed order. Where it is loaded, a
# layer runs only it up to ROW_INVARIANT_ROWS rows (decode, verify, batched steps), so the kernel plan cannot
# make speculative output differ from plain decoding; beyond (prefill chunks) the plan measures it against
# the others. Activations per block of 32: int8 (vpdpbusd once, as llama.cpp's Q8 blocks) or int16 (twice),
# a choice of format (``--activations``); the kernel name carries it, so plans and stored graphs differ. It is
# also the static rule at every row count (measured plans took it at every bucket: benchmarks/results/row-invariant/).
ROWS_Q4, ROWS_I8 = "q4_rows", "i8_rows"  # the operators
# --activations: bits of the quantized activations per kind of layer (its attribute name; "*": the rest)
ACTIVATIONS: dict[str, dict[str, int]] = {
    "int16": {"*": 16},
    "int8": {"*": 8},
    # int16 where int8 cost most perplexity (the inputs of the attention projections and of down_proj), int8
    # for the rest (gate_up, o_proj, lm_head: 68% of the multiply-adds)
    "mixed": {"qkv_proj": 16, "down_proj": 16, "*": 8},
}
# int16 by measurement: held-out perplexity 15.955 against bf16 native's 15.923 and llama.cpp's 15.996 on the
# same GGUF and text; int8 16.215, mixed 16.001; int8 verifies cheaper (benchmarks/results/row-invariant/)
DEFAULT_ACTIVATIONS = "int16"
ACTIVATION_BITS = (8, 16)  # what the row-invariant family's kernels take
ROW_INVARIANT_ROWS = 16
_ROWS_TILE = 16  # output rows a tile of the packed layout


def rows_kernel(op: str, bits: int) -> str:
    """The kernel name of the row-invariant family for ``op`` (ROWS_Q4, ROWS_I8) at ``bits``-bit activations."""
    return f"{op}_a{bits}"


def activation_bits(name: str, kind: str = "*") -> int:
    """Bits the ``--activations`` choice ``name`` gives layers of ``kind`` (a layer's attribute name, e.g.
    ``down_proj``); an unknown name is refused, naming the known ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activations {name!r}; use one of {', '.join(ACTIVATIONS)}")
    policy = ACTIVATIONS[name]
    return policy.get(kind, policy["*"])


def set_activations(model: nn.Module, name: str) -> int:
    """Quantize the activations of ``model``'s int8 and 4-bit layers as ``name`` (ACTIVATIONS) says for each
    kind of layer, where they run the row-invariant family; returns how many layers were set."""
    activation_bits(name)
    count = 0
    for path, m in model.named_modules():
        if isinstance(m, (Int8Linear, Int4Linear)):
            m.act_bits = activation_bits(name, path.rsplit(".", 1)[-1])
            count += 1
    return count


def pack_q4_rows(q: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """q [out, in] (0..15), scales and zeros [out, in / 32] in the layout of ``specdecode::q4_rows``: per tile of
    16 output rows and block of 32 inputs, 4 x 64 bytes of nibbles (chunk c, row j, byte b: the low nibble is
    weight 8c + b of row j, the high nibble weight 8c + 4 + b), then the 16 rows' bf16 scales and bf16 zeros;
    returned as uint8 [out, in / 32 * 20]."""
    n, k = q.shape
    g, t = k // 32, n // _ROWS_TILE
    r = q.to(torch.uint8).reshape(t, _ROWS_TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # tile, block, c, j, b, half
    nibbles = (r[..., 0] | (r[..., 1] << 4)).reshape(t, g, 256)

    def by_tile(v: Tensor) -> Tensor:
        return v.to(torch.bfloat16).reshape(t, _ROWS_TILE, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((nibbles, by_tile(scales), by_tile(zeros)), dim=2).reshape(n, g * 20).contiguous()


def pack_i8_rows(w: Tensor) -> Tensor:
    """int8 w [out, in] in the layout of ``specdecode::i8_rows``: per tile of 16 output rows and block of 32
    inputs, 8 x 64 bytes (chunk c, row j, byte b: weight 4c + b of row j plus 128, unsigned); uint8 [out, in]."""
    n, k = w.shape
    r = w.reshape(n // _ROWS_TILE, _ROWS_TILE, k // 32, 8, 4).permute(0, 2, 3, 1, 4)
    return (r.to(torch.int16) + 128).to(torch.uint8).reshape(n, k).contiguous()


def _rows_packable(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    return (out_features % _ROWS_TILE == 0 and in_features % 32 == 0 and dtype == torch.bfloat16
            and device.type == "cpu")


# From this many rows a compiled graph takes the plan's packed choice as it is (the dequantized weight folded
# in and packed by inductor); below, the nearest smaller unpacked choice (QuantizedDispatch)
GRAPH_FOLD_MIN_ROWS = 32


class QuantizedDispatch(KernelDispatch):
    """Kernel dispatch of a layer with quantized weights: in a compiled graph a packed choice would fold the
    dequantized weight in (``aten``: bf16, 2-4x the bytes), so below ``GRAPH_FOLD_MIN_ROWS`` rows the graph
    runs the plan's choice at the largest smaller row bucket that is not packed (the layer's own rule if
    none). On the Zen4 EPYC a folded weight cost more than twice the unfolded kernel at 8 rows and won from
    32 rows, where data build's 128-row steps had run slower compiled than eager (docs/compiled.md,
    docs/LOG.md)."""

    rows_op: str = ""  # the row-invariant family's operator for this kind of layer (ROWS_Q4, ROWS_I8)
    rows_packed: Tensor  # the layer's weights in that operator's layout (pack_q4_rows, pack_i8_rows), or empty
    act_bits: int  # the family's activation bits (set_activations)

    def rows_kernel(self) -> str | None:
        """The row-invariant family's kernel where this layer runs it, else None."""
        return (rows_kernel(self.rows_op, self.act_bits) if self.rows_packed.numel() and native_loaded(self.rows_op)
                else None)

    def rows_key(self) -> str:
        """The group key's suffix: the activation bits where the layer has the family's layout."""
        return f":a{self.act_bits}" if self.rows_packed.numel() else ""

    def graph_kernel(self, rows: int, x: Tensor, kernel: str) -> str:
        if rows >= GRAPH_FOLD_MIN_ROWS:  # many rows: the folded, packed weight pays for its bytes
            return super().graph_kernel(rows, x, kernel)
        if self.kernels is not None:
            for smaller in reversed(self.kernels[:bucket_of(rows)]):
                if smaller not in PACKED_KERNELS:
                    return smaller
        return self.static_kernel(rows, x)


class Int8Linear(QuantizedDispatch, nn.Module):
    """A linear layer with int8 weights and one scale per output channel: y = (x @ q^T) * s (+ b)."""

    weight_int8: Tensor  # [out, in] int8 (a buffer)
    scales: Tensor  # [out] in the model dtype (a buffer)
    rows_op = ROWS_I8

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        # symmetric, per output channel; an all-zero row keeps scale 1 (its q is all zero)
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # the row-invariant family's layout of the same weights (bf16 layers on a CPU)
        packable = _rows_packable(self.out_features, self.in_features, weight.dtype, weight.device)
        self.register_buffer("rows_packed", pack_i8_rows(self.weight_int8) if packable else
                             torch.empty(0, dtype=torch.uint8), persistent=False)
        self.act_bits = activation_bits(DEFAULT_ACTIVATIONS)  # set_activations sets each kind

    def dequantized(self) -> Tensor:
        """The weight this layer computes with, in the model dtype (for tests and reference)."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def plan_applies(self, x: Tensor) -> bool:
        return x.dtype == self.scales.dtype

    def static_kernel(self, rows: int, x: Tensor) -> str:
        # the static rule, without building the candidate list per call
        if x.dtype == self.scales.dtype and (kernel := self.rows_kernel()):  # at any row count: see ROWS_Q4
            return kernel
        return ("int8pack" if rows <= _KERNEL_MAX_ROWS and x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
                and x.dtype == self.scales.dtype else "aten")

    def run_kernel(self, kernel: str, x2: Tensor) -> Tensor:
        """(x2 @ q^T) * s (+ b) with the named kernel: ``int8pack`` (aten._weight_int8pack_mm),
        ``aten`` (q converted exactly to the model dtype, one GEMM) or ``onednn`` (the same
        converted weight, packed once)."""
        if kernel == "int8pack":
            out = cast(Tensor, torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scales))
        elif (op := NATIVE_I8_KERNELS.get(kernel)) is not None:
            out = cast(Tensor, getattr(torch.ops.specdecode, op)(x2, self.weight_int8, self.scales))
        elif kernel.startswith(ROWS_I8):
            out = cast(Tensor, torch.ops.specdecode.i8_rows(x2, self.rows_packed, self.scales, self.act_bits))
        elif kernel == "onednn" and self.packed is not None:
            out = onednn_linear(x2, self.packed, None) * self.scales
        else:
            out = F.linear(x2, self.weight_int8.to(x2.dtype)) * self.scales.to(x2.dtype)
        return out if self.bias is None else out + self.bias

    def group_key(self) -> str:
        return f"int8:{self.out_features}x{self.in_features}:{str(self.scales.dtype).removeprefix('torch.')}" \
            + self.rows_key()

    def kernel_candidates(self, rows: int) -> tuple[str, ...]:
        dtype, device = self.scales.dtype, self.scales.device
        invariant = self.rows_kernel()
        if invariant is not None and rows <= ROW_INVARIANT_ROWS:
            return (invariant,)
        found = [invariant] if invariant is not None else []
        found.append("aten")
        if device.type == "cpu" and dtype in _KERNEL_DTYPES:
            found.append("int8pack")
        if device.type == "cpu" and dtype == torch.bfloat16 and self.in_features % 32 == 0:
            found += [name for name, op in NATIVE_I8_KERNELS.items() if native_loaded(op)]
        if onednn_usable(dtype, device):
            found.append("onednn")
        return tuple(found)

    def packable_weight(self, kernel: str = "onednn") -> Tensor:
        return self.weight_int8.to(self.scales.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# 4-bit weights: aten._weight_int4pack_mm_for_cpu reads SmolLM2's layer matrices at 22-28 GB/s of
# int4 at one row (gate_up [3072x576] 33 us, bf16 oneDNN packed 57-86 us, the int8 kernel about
# twice the bytes of int4 at the same speed) but its cost grows with the rows (gate_up: 42 us at
# 3 rows, 91 at 8, 340 at 32), so larger row counts get the weight dequantized once and packed
# for oneDNN when the kernel plan measures that faster. Measured here, 2 threads, weights
# streamed from memory.
_INT4_GROUP = 32




class Int4Linear(QuantizedDispatch, nn.Module):
    """A linear layer with 4-bit weights in groups of 32 along the input, each group with a scale
    and a zero: w = (q - 8) * scale + zero for q in 0..15 (so Q4_1's d * q + m has scale d, zero
    m + 8d, and Q4_0's d * (q - 8) has zero 0). y = x @ w^T."""

    qs: Tensor  # [out, in / 2] uint8: per group of 32, q[j] | q[j + 16] << 4 (GGUF's order; a buffer)
    int4pack: Tensor  # the CPU kernel's packed layout of q (a buffer)
    scales_and_zeros: Tensor  # [in / 32, out, 2] in the model dtype (a buffer)
    scales: Tensor  # [out, in / 32] in the model dtype: the same scales, row by row, for the native kernels
    zeros: Tensor  # [out, in / 32] in the model dtype: the same zeros (q4_avx2, q4_avx512 form zero - 8 * scale)
    rows_op = ROWS_Q4

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor, dtype: torch.dtype) -> None:
        """q [out, in] integers 0..15; scales, zeros [out, in / 32] (float32, as the file gives them)."""
        super().__init__()
        out_f, in_f = q.shape
        if in_f % _INT4_GROUP or scales.shape != (out_f, in_f // _INT4_GROUP) or zeros.shape != scales.shape:
            raise ValueError(f"4-bit weight {tuple(q.shape)} needs groups of {_INT4_GROUP} along the input and "
                             f"scales/zeros [{out_f}, {in_f // _INT4_GROUP}], got {tuple(scales.shape)}")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("4-bit weight values must lie in 0..15")
        self.in_features, self.out_features = in_f, out_f
        halves = q.to(torch.uint8).reshape(out_f, in_f // _INT4_GROUP, 2, _INT4_GROUP // 2)
        self.register_buffer("qs", (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_f, in_f // 2).contiguous())
        # the CPU kernel packs 16 output rows at a time; other shapes run the other kernels
        self.register_buffer("int4pack", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).cpu().contiguous(), 1) if out_f % 16 == 0 else torch.empty(0, dtype=torch.uint8))
        sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()
        self.register_buffer("scales_and_zeros", sz)
        # every kernel computes with the same (model-dtype) scales and zeros. The native kernels read them row
        # by row in that dtype (bf16: 0.625 bytes a weight with qs, where fp32 scales and mins made 0.75)
        self.register_buffer("scales", sz[..., 0].t().contiguous())
        self.register_buffer("zeros", sz[..., 1].t().contiguous())
        self.bias = None
        packable = _rows_packable(out_f, in_f, dtype, q.device)
        self.register_buffer("rows_packed", pack_q4_rows(q, self.scales, self.zeros) if packable else
                             torch.empty(0, dtype=torch.uint8), persistent=False)
        self.act_bits = activation_bits(DEFAULT_ACTIVATIONS)  # set_activations sets each kind

    def unpacked(self) -> Tensor:
        """q [out, in] uint8 in 0..15."""
        out_f, in_f = self.out_features, self.in_features
        b = self.qs.view(out_f, in_f // _INT4_GROUP, 1, _INT4_GROUP // 2)
        return torch.cat((b & 15, b >> 4), dim=2).reshape(out_f, in_f)

    def dequantized(self) -> Tensor:
        """The weight this layer computes with [out, in], in float32."""
        sz = self.scales_and_zeros.float().repeat_interleave(_INT4_GROUP, dim=0)  # [in, out, 2]
        return (self.unpacked().float() - 8) * sz[..., 0].t() + sz[..., 1].t()

    def plan_applies(self, x: Tensor) -> bool:
        return x.dtype == self.scales_and_zeros.dtype

    def static_kernel(self, rows: int, x: Tensor) -> str:
        if x.dtype == self.scales.dtype and (kernel := self.rows_kernel()):  # at any row count: see ROWS_Q4
            return kernel
        return "int4pack" if x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and self.int4pack.numel() else "aten"

    def run_kernel(self, kernel: str, x2: Tensor) -> Tensor:
        """x2 @ w^T with the named kernel: ``int4pack`` (aten._weight_int4pack_mm_for_cpu), ``q4_avx2`` /
        ``q4_avx512`` (the project's own, activations in int16 per block of 32: core/csrc), ``onednn``
        (the dequantized weight, packed once) or ``aten`` (dequantized on every call: reference)."""
        if kernel == "int4pack":
            return cast(Tensor, torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.int4pack, _INT4_GROUP, self.scales_and_zeros))
        if (op := NATIVE_Q4_KERNELS.get(kernel)) is not None:
            return cast(Tensor, getattr(torch.ops.specdecode, op)(x2, self.qs, self.scales, self.zeros))
        if kernel.startswith(ROWS_Q4):
            return cast(Tensor, torch.ops.specdecode.q4_rows(x2, self.rows_packed, self.act_bits))
        if kernel == "onednn" and self.packed is not None:
            return onednn_linear(x2, self.packed, None)
        if kernel == ONEDNN_F32 and self.packed is not None:
            return onednn_f32_linear(x2, self.packed, None)
        return F.linear(x2, self.dequantized().to(x2.dtype))

    def group_key(self) -> str:
        dtype = str(self.scales_and_zeros.dtype).removeprefix("torch.")
        return f"int4:{self.out_features}x{self.in_features}:{dtype}" + self.rows_key()

    def kernel_candidates(self, rows: int) -> tuple[str, ...]:
        dtype, device = self.scales_and_zeros.dtype, self.scales_and_zeros.device
        invariant = self.rows_kernel()
        if invariant is not None and rows <= ROW_INVARIANT_ROWS:
            return (invariant,)
        found = [invariant] if invariant is not None else []
        if device.type == "cpu" and dtype in _KERNEL_DTYPES and self.int4pack.numel():
            found.append("int4pack")
        if device.type == "cpu" and dtype == torch.bfloat16:
            found += [name for name, op in NATIVE_Q4_KERNELS.items() if native_loaded(op)]
        if onednn_usable(dtype, device):
            found.append("onednn")
        if onednn_f32_offered(dtype, device):
            found.append(ONEDNN_F32)  # the dequantized weight in fp32: 8x the 4-bit bytes, for many rows
        return tuple(found) or ("aten",)  # aten dequantizes on every call: the reference, not a contender

    def packable_weight(self, kernel: str = "onednn") -> Tensor:
        w = self.dequantized()  # float32
        return w if kernel == ONEDNN_F32 else w.to(self.scales_and_zeros.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={_INT4_GROUP}"


def quantize_q4(weight: Tensor) -> Int4Linear:
    """A float weight [out, in] as 4-bit groups of 32 along the input (``Int4Linear``): for each group the
    range (its minimum and maximum, each pulled in by up to 15% of the span) and then the scale and offset
    refitted by least squares to the codes it gives, whichever of those has the least squared error (the
    search llama.cpp's ``make_qkx2_quants`` does for its K-quants): a drafter's layers, which no file ships
    in 4 bits."""
    w = weight.detach().float()
    out_f, in_f = w.shape
    g = w.reshape(-1, _INT4_GROUP)
    lo0, hi0 = g.amin(-1), g.amax(-1)
    span = (hi0 - lo0).clamp_min(1e-30)
    best_err = torch.full_like(lo0, float("inf"))
    best_q, best_scale, best_lo = torch.zeros_like(g), torch.ones_like(lo0), lo0.clone()
    shrinks = (0.0, 0.05, 0.1, 0.15)
    for a in shrinks:
        for b in shrinks:
            lo, hi = lo0 + a * span, hi0 - b * span
            scale = ((hi - lo) / 15).clamp_min(1e-30)
            q = torch.round((g - lo[:, None]) / scale[:, None]).clamp(0, 15)
            qm, wm = q.mean(-1), g.mean(-1)  # least squares scale and offset for these codes
            var = ((q - qm[:, None]) ** 2).sum(-1)
            s_ls = ((q - qm[:, None]) * (g - wm[:, None])).sum(-1) / var.clamp_min(1e-30)
            fit = (var > 0) & (s_ls > 0)
            lo, scale = torch.where(fit, wm - s_ls * qm, lo), torch.where(fit, s_ls, scale)
            err = ((q * scale[:, None] + lo[:, None] - g) ** 2).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better[:, None], q, best_q)
            best_scale, best_lo = torch.where(better, scale, best_scale), torch.where(better, lo, best_lo)
    q = best_q.reshape(out_f, in_f)
    scale, lo = best_scale.reshape(out_f, -1), best_lo.reshape(out_f, -1)
    return Int4Linear(q.to(torch.uint8), scale, lo + 8 * scale, weight.dtype)  # w = (q - 8) * scale + zero


# A drafter's weight formats (``--drafter-weights``): its linear layers (fc, attention, MLP, its head) kept as
# loaded, per-channel int8 (``Int8Linear``), or 4-bit groups (``quantize_q4``); norms and the shared
# embedding stay as they are. Which is the default: ``runtime.autoformat.resolve_drafter_weights``.
DRAFTER_WEIGHT_FORMATS = ("native", "int8", "q4")


def quantize_linears(module: nn.Module, weights: str) -> int:
    """Every plain linear layer of ``module`` (not the modules it holds outside its tree) put in ``weights``
    (``DRAFTER_WEIGHT_FORMATS``), in place, activations at the default bits; returns how many changed."""
    if weights not in DRAFTER_WEIGHT_FORMATS:
        raise ValueError(f"unknown drafter weight format {weights!r}; use one of {', '.join(DRAFTER_WEIGHT_FORMATS)}")
    if weights == "native":
        return 0
    found = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    unfit = [f"{name} ({child.in_features} inputs, bias: {child.bias is not None})" for _, name, child in found
             if weights == "q4" and (child.in_features % _INT4_GROUP or child.bias is not None)]
    if unfit:  # refused before any layer changes: the module is left as it was
        raise ValueError(f"{', '.join(unfit)}: the 4-bit format takes whole groups of {_INT4_GROUP} inputs and no "
                         "bias; use --drafter-weights int8 or native")
    for parent, name, child in found:
        setattr(parent, name, Int8Linear(child.weight, child.bias) if weights == "int8" else quantize_q4(child.weight))
    set_activations(module, DEFAULT_ACTIVATIONS)
    return len(found)


def check_weight_format(weights: str) -> None:
    """Refuse an unknown weight format, naming the known ones."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; use one of {', '.join(WEIGHT_FORMATS)}")


def quantize_weights(model: nn.Module, weights: str) -> int:
    """Put ``model``'s linear layers in the ``weights`` format, in place; returns how many
    layers changed. ``native`` changes nothing. A weight shared with another module (the tied
    lm_head) gets its own int8 copy; the embedding keeps the original. ``q4`` needs the file's
    blocks: ``io.gguf.apply_gguf_q4`` puts those layers in place first, and the linear layers
    left (not 4-bit in the file) become int8 here."""
    check_weight_format(weights)
    if weights == "native":
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child.weight, child.bias))
    set_activations(model, DEFAULT_ACTIVATIONS)
    return len(targets)


def detect_format(model: nn.Module) -> str:
    """The format ``model``'s linear layers are in (``q4`` as soon as one is 4-bit, else ``int8``
    as soon as one is int8)."""
    kinds = {type(m) for m in model.modules()}
    return "q4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else "native"
