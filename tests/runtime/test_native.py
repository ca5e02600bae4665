"""The project's own CPU kernels (runtime.native, core/csrc): built once per source version, offered to
the kernel plan only when loaded, equal to the formula, traceable into compiled steps."""

import pytest
import torch

from specdecode.core.attention import (
    NATIVE_ATTENTION,
    NATIVE_ATTENTION_AVX512,
    SMALL_QUERY,
    attention_op,
    native_attention,
    small_query_attention,
)
from specdecode.core.quant import (
    NATIVE_I8_KERNELS,
    NATIVE_Q4_KERNELS,
    ROW_INVARIANT_ROWS,
    ROWS_I8,
    ROWS_Q4,
    Int4Linear,
    Int8Linear,
    native_loaded,
    pack_q4_rows,
)
from specdecode.runtime import native

# (4-bit kernel, int8 kernel) of each module: AVX2, and AVX-512 VNNI where the CPU has it
ISAS = {"avx2": ("q4_avx2", "i8_avx2"), "avx512": ("q4_avx512", "i8_avx512")}


def test_why_unavailable_names_the_cause(monkeypatch):
    monkeypatch.delenv("SPECDECODE_NATIVE", raising=False)
    assert native.why_unavailable(frozenset({"avx2", "fma", "sse2"})) is None
    assert native.why_unavailable(frozenset({"avx2"})) == "the CPU lacks fma"
    assert "avx2" in native.why_unavailable(frozenset({"neon"}))
    monkeypatch.setenv("SPECDECODE_NATIVE", "0")
    assert native.why_unavailable(frozenset({"avx2", "fma"})) == "SPECDECODE_NATIVE=0"
    monkeypatch.delenv("SPECDECODE_NATIVE")
    avx512 = native.MODULES[1]
    assert native.why_unavailable(frozenset({"avx2", "fma"}), avx512) == (
        "the CPU lacks avx512_vnni, avx512bw, avx512f, avx512vl")
    assert native.why_unavailable(frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}), avx512) is None
    monkeypatch.setenv("SPECDECODE_NATIVE", "avx2")  # an A/B of the modules: only those named load
    assert native.why_unavailable(frozenset({"avx2", "fma"})) is None
    assert native.why_unavailable(frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}), avx512) == (
        "SPECDECODE_NATIVE=avx2 (the modules to load, of avx2, avx512, rows, attention, attention512)")


def test_every_module_is_listed_with_its_operators():
    """Each kernel name the plan can choose runs an operator that some module registers."""
    ops = {op for m in native.MODULES for op in m.ops}
    named = set(NATIVE_Q4_KERNELS.values()) | set(NATIVE_I8_KERNELS.values())
    assert named | {NATIVE_ATTENTION, NATIVE_ATTENTION_AVX512, ROWS_Q4, ROWS_I8} == ops
    assert {m.name for m in native.MODULES} == {*ISAS, "rows", "attention", "attention512"}
    assert all(m.source.exists() for m in native.MODULES)


@pytest.fixture(scope="module")
def loaded():
    reason = native.load_native()
    if reason is not None:
        pytest.skip(f"native kernels unavailable here: {reason}")
    assert native_loaded()


@pytest.fixture(params=list(ISAS))
def isa(request, loaded):
    """One module's kernels, skipped where this CPU cannot run them."""
    module = next(m for m in native.MODULES if m.name == request.param)
    if not all(native_loaded(op) for op in module.ops):
        pytest.skip(f"{module.name} kernels unavailable here: {native.why_unavailable(None, module)}")
    return ISAS[request.param]


def _layer(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales, zeros = torch.rand(n, k // 32, generator=g) / 10 + 0.01, torch.randn(n, k // 32, generator=g) / 10
    return Int4Linear(q, scales, zeros, dtype), g


def _check_formula(layer, kernel, n, k, dtype, g):
    """1-17 activation rows (the kernel's 2-row tile and the rest) against the layer's own dequantized
    weight in float64. The activations' int16 step is 2^-15 of each block's largest value: float32
    results agree to ~1e-4 of the output's scale, which is why the plan offers these kernels to bf16
    layers only."""
    # beyond the rows the row-invariant family keeps to itself
    assert (kernel in layer.kernel_candidates(ROW_INVARIANT_ROWS + 1)) == (dtype == torch.bfloat16)
    w = layer.dequantized().double()
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, k, generator=g).to(dtype)
        out = layer.run_kernel(kernel, x)
        assert out.dtype == dtype and out.shape == (rows, n)
        ref = x.double() @ w.t()
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-4), (kernel, n, k, rows, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["q4", "i8"])
def test_kernel_is_the_formula(isa, dtype, kind):
    """4-bit blocks and int8 rows (the q4 format's lm_head); output rows not a multiple of the kernel's
    4-row tile, and a 1536-wide input."""
    for n, k in ((45, 64), (64, 1536)):
        if kind == "q4":
            layer, g = _layer(n, k, dtype)
        else:
            g = torch.Generator().manual_seed(n)
            layer = Int8Linear(torch.randn(n, k, generator=g).to(dtype))
        _check_formula(layer, isa[0] if kind == "q4" else isa[1], n, k, dtype, g)


def test_avx512_kernels_compute_what_the_avx2_ones_do(loaded):
    """The same activations (int16 per block, same rounding) and exact int32 sums: only the order of the
    fp32 sums differs, so the two modules agree to float32's rounding, in fp32 and at every row count
    the tiles take (4, 2, 1), odd block counts (an unpaired last block) included."""
    if not native_loaded("q4_linear_avx512"):
        pytest.skip(f"avx512 kernels unavailable here: {native.why_unavailable(None, native.MODULES[1])}")
    for n, k in ((45, 96), (64, 1536), (9, 32)):
        q4, g = _layer(n, k, torch.float32, seed=k)
        i8 = Int8Linear(torch.randn(n, k, generator=g))
        for rows in (1, 2, 3, 4, 7):
            x = torch.randn(rows, k, generator=g)
            for layer, (a, b) in ((q4, ("q4_avx2", "q4_avx512")), (i8, ("i8_avx2", "i8_avx512"))):
                ya, yb = layer.run_kernel(a, x), layer.run_kernel(b, x)
                assert float((ya - yb).abs().max() / ya.abs().max()) < 1e-5, (n, k, rows, a)


def test_q4_kernel_massive_activation_and_non_finite(isa):
    """A block with one huge value (SmolLM2's first token: ~2.5e4 beside values of ~1): in bf16 the
    kernel's error is within twice aten's int4pack's on the same input (both round to bf16); a non-finite
    input gives a non-finite output, never a silent number."""
    layer, g = _layer(32, 64, torch.bfloat16, seed=3)
    x = torch.randn(1, 64, generator=g)
    x[0, 5] = 2.5e4
    x = x.to(torch.bfloat16)
    ref = x.double() @ layer.dequantized().double().t()
    ours = float((layer.run_kernel(isa[0], x).double() - ref).abs().max())
    aten = float((layer.run_kernel("int4pack", x).double() - ref).abs().max())
    assert ours <= 2 * aten + 1e-6, (ours, aten)
    x[0, 40] = float("inf")
    assert not torch.isfinite(layer.run_kernel(isa[0], x)).all()


@pytest.mark.parametrize("kind", ["q4", "i8"])
def test_kernel_threads_and_odd_inputs(isa, kind):
    """Enough output rows for at::parallel_for to split them over two threads (more than 16 tiles of
    4), with a tail of 3; a non-contiguous input (a column slice, a transpose); no rows at all."""
    n, k = 203, 96
    g = torch.Generator().manual_seed(11)
    layer = _layer(n, k, torch.bfloat16, seed=11)[0] if kind == "q4" else Int8Linear(
        torch.randn(n, k, generator=g).to(torch.bfloat16))
    kernel = isa[0] if kind == "q4" else isa[1]
    w = layer.dequantized().double()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wide = torch.randn(5, k + 32, generator=g).to(torch.bfloat16)
        for x in (torch.randn(5, k, generator=g).to(torch.bfloat16), wide[:, 16:16 + k],
                  torch.randn(k, 3, generator=g).to(torch.bfloat16).t()):
            ref = x.double() @ w.t()
            out = layer.run_kernel(kernel, x)
            assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-2
            assert torch.equal(out, layer.run_kernel(kernel, x.contiguous()))
        assert layer.run_kernel(kernel, torch.empty(0, k, dtype=torch.bfloat16)).shape == (0, n)
    finally:
        torch.set_num_threads(threads)


def test_kernel_tiny_blocks_and_nan(isa):
    """Values near float32's smallest normal (32767 / top overflows) are quantized like any others, not
    turned to garbage; a nan anywhere in a block gives a non-finite output."""
    q4 = getattr(torch.ops.specdecode, NATIVE_Q4_KERNELS[isa[0]])
    layer, g = _layer(8, 64, torch.float32, seed=7)
    layer_bf = _layer(8, 64, torch.bfloat16, seed=7)[0]
    x = torch.randn(1, 64, generator=g) * 1e-36
    ref = x.double() @ layer.dequantized().double().t()
    for lay in (layer, layer_bf):
        out = q4(x.to(lay.scales_and_zeros.dtype), lay.qs, lay.scales, lay.zeros).double()
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-2
    x[0, 3] = float("nan")
    assert not torch.isfinite(q4(x, layer.qs, layer.scales, layer.zeros)).any()


def test_q4_kernel_refuses_bad_shapes(isa):
    q4, i8 = (getattr(torch.ops.specdecode, NATIVE_Q4_KERNELS[isa[0]]),
              getattr(torch.ops.specdecode, NATIVE_I8_KERNELS[isa[1]]))
    layer, _ = _layer(32, 64, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q4(torch.randn(1, 48), layer.qs, layer.scales, layer.zeros)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        q4(torch.randn(1, 64, dtype=torch.float64), layer.qs, layer.scales, layer.zeros)
    with pytest.raises(RuntimeError, match="int8"):
        i8(torch.randn(1, 64), layer.qs, torch.ones(32))
    with pytest.raises(RuntimeError, match="qs must be contiguous uint8"):  # 1-d: refused before its size is read
        q4(torch.randn(1, 64), layer.qs.flatten(), layer.scales, layer.zeros)
    with pytest.raises(RuntimeError, match="w must be contiguous int8"):
        i8(torch.randn(1, 64), torch.zeros(64, dtype=torch.int8), torch.ones(32))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        q4(torch.randn(1, 64), layer.qs, layer.scales, layer.zeros.to(torch.bfloat16))


def test_q4_kernel_reads_bf16_scales_and_zeros_exactly(isa):
    """A bf16 layer's scales and zeros stream in bf16 (0.125 bytes a weight, not fp32's 0.25); the kernel
    forms zero - 8 * scale in fp32 from them, so its output equals the same values given as fp32, bit for bit
    (1-5 rows, a width whose block count is not a multiple of the vector width)."""
    q4 = getattr(torch.ops.specdecode, NATIVE_Q4_KERNELS[isa[0]])
    layer, g = _layer(36, 32 * 21, torch.bfloat16, seed=11)
    assert layer.scales.dtype == layer.zeros.dtype == torch.bfloat16
    for rows in (1, 2, 5):
        x = torch.randn(rows, 32 * 21, generator=g).to(torch.bfloat16)
        assert torch.equal(q4(x, layer.qs, layer.scales, layer.zeros),
                           q4(x, layer.qs, layer.scales.float(), layer.zeros.float()))


def test_q4_kernel_compiles_into_a_graph(isa):
    """The operator traces (its fake) and the compiled layer equals eager, planned on the native kernel."""
    layer, g = _layer(64, 128, torch.bfloat16, seed=5)
    layer.kernels = (isa[0],) * 8
    x = torch.randn(1, 128, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True)(x)
    assert torch.equal(compiled, eager * 2)


def _attention_case(B, T, S, dtype, masked, seed=0, D=64, kv=3, group=3):
    """q [B, kv * group, T, D]; k, v views of a cache longer than S (as the model passes them); a random
    per-row mask in which every query sees key 0 (as every caller's masks do)."""
    g = torch.Generator().manual_seed(seed)
    ck, cv = (torch.randn(B, kv, S + 7, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, kv * group, T, D, generator=g).to(dtype)
    mask = None
    if masked:
        mask = torch.rand(B, 1, T, S, generator=g) > 0.4
        mask[..., 0] = True
    return q, ck[:, :, :S], cv[:, :, :S], mask


def _attention_reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1), attn_mask=mask)


# (operator, dtype): the AVX2 kernel takes fp32 and bf16, the AVX-512 BF16 one bf16
ATTENTION_CASES = [(NATIVE_ATTENTION, torch.float32), (NATIVE_ATTENTION, torch.bfloat16),
                   (NATIVE_ATTENTION_AVX512, torch.bfloat16)]


def attention_kernel(name):
    if not native_loaded(name):
        pytest.skip(f"{name} is not loaded here (the CPU lacks its instructions)")
    return getattr(torch.ops.specdecode, name)


@pytest.mark.parametrize(("name", "dtype"), ATTENTION_CASES)
def test_attention_kernel_is_attention(loaded, name, dtype):
    """Decode (1 query), verify (3-16 tokens), batches of rows with their own masks, key counts that are
    not a multiple of the kernels' 8- and 16-key blocks, heads of 64, 96 and 128: against float64 attention.
    bf16 within its output's rounding (the kernels' scores and sums are fp32)."""
    op = attention_kernel(name)
    for B, T, S, masked, D in ((1, 1, 200, False, 64), (1, 3, 57, True, 64), (4, 5, 301, True, 64),
                               (2, 16, 1000, True, 64), (3, 1, 9, True, 128), (1, 2, 1, False, 64),
                               (1, 8, 33, True, 96)):
        q, k, v, mask = _attention_case(B, T, S, dtype, masked, seed=S, D=D)
        kv = k.shape[1]
        rows = None if mask is None else mask.reshape(-1, T, S)
        out = op(q.reshape(B, kv, -1, D), k, v, rows, T).view(q.shape)
        assert out.dtype == dtype
        ref = _attention_reference(q, k, v, mask)
        # bf16: each output rounded once (half a unit in its last place, 2^-8 relative) after fp32 arithmetic
        bound = ref.abs() * 2**-8 + 1e-4 if dtype == torch.bfloat16 else torch.full_like(ref, 2e-6)
        excess = float(((out.double() - ref).abs() - bound).max())
        assert excess <= 0, (B, T, S, masked, D, excess)


@pytest.mark.parametrize(("name", "dtype"), ATTENTION_CASES[1:])
def test_attention_kernel_masks_exactly_and_refuses_bad_input(loaded, name, dtype):
    """A masked key contributes nothing (the same output with its value changed); one mask for every row
    broadcasts; bad shapes and dtypes are refused with what is wrong."""
    op = attention_kernel(name)
    q, k, v, _ = _attention_case(2, 2, 20, dtype, False)
    qg = q.reshape(2, 3, 6, 64)
    mask = torch.ones(1, 2, 20, dtype=torch.bool)
    mask[:, :, 5] = False
    out = op(qg, k, v, mask, 2)
    v2 = v.clone()
    v2[:, :, 5] = 1e6
    assert torch.equal(op(qg, k, v2, mask, 2), out)
    assert not torch.equal(op(qg, k, v2, None, 2), op(qg, k, v, None, 2))
    with pytest.raises(RuntimeError, match="mask must be bool"):
        op(qg, k, v, mask.float(), 2)
    with pytest.raises(RuntimeError, match="multiple of tokens"):
        op(qg.reshape(2, 3, 4, 96)[..., :64].contiguous(), k, v, None, 3)
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16" if name == NATIVE_ATTENTION
                       else "all be bfloat16"):
        op(qg.double(), k.double(), v.double(), None, 2)
    with pytest.raises(RuntimeError, match="multiple of 8" if name == NATIVE_ATTENTION else "multiple of 32"):
        op(qg[..., :60].contiguous(), k[..., :60].contiguous(), v[..., :60].contiguous(), None, 2)


def test_bf16_few_query_attention_runs_the_kernel_into_a_graph(loaded):
    """The model's few-query attention takes the kernel for bf16 decode and verify calls (1-16 queries) on a
    CPU (fp32 and float64 stay on SDPA, whose results exactness tests compare with transformers, and so do
    prefill chunks of more tokens); it traces into a compiled graph (its fake)."""
    q, k, v, mask = _attention_case(2, 1, 40, torch.bfloat16, True, seed=3)
    assert native_attention(q) and not native_attention(q.float()) and not native_attention(q.double())
    # the AVX-512 BF16 kernel where loaded, for heads of a multiple of 32; else the AVX2 one
    best = NATIVE_ATTENTION_AVX512 if native_loaded(NATIVE_ATTENTION_AVX512) else NATIVE_ATTENTION
    assert attention_op(q) == best and attention_op(q[..., :40]) == NATIVE_ATTENTION
    assert native_attention(_attention_case(2, 3, 40, torch.bfloat16, True, seed=3)[0])
    assert not native_attention(_attention_case(1, SMALL_QUERY + 1, 40, torch.bfloat16, True, seed=3)[0])
    with torch.inference_mode():
        eager = small_query_attention(q, k, v, mask)
        compiled = torch.compile(lambda *a: small_query_attention(*a) * 2, fullgraph=True)(q, k, v, mask)
    assert torch.equal(compiled, eager * 2)
    ref = _attention_reference(q, k, v, mask)
    assert bool(((eager.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all())


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start(tmp_path, monkeypatch):
    """torch's extension builder waits without end while its ``lock`` file exists; a process killed while
    loading left one, and every later start hung. Under our own flock the file is known stale and removed."""
    from pathlib import Path

    from torch.utils import cpp_extension

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    module = native.MODULES[0]
    where = tmp_path / "native" / f"specdecode_{module.name}_{native.source_identity(module)}"
    where.mkdir(parents=True)
    (where / "lock").touch()  # the baton of a build whose process was killed

    def load(name, sources, build_directory, **kwargs):
        assert not (Path(build_directory) / "lock").exists(), "torch's builder would wait here forever"

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_register_fake", lambda op: None)
    assert native._build(module, None) is None


# --- the row-invariant integer family (rows_linear.cpp) ---

@pytest.fixture(scope="module")
def rows_family(loaded):
    module = next(m for m in native.MODULES if m.name == "rows")
    if not all(native_loaded(op) for op in module.ops):
        pytest.skip(f"rows kernels unavailable here: {native.why_unavailable(None, module)}")


def _quantized_reference(x, bits):
    """x's values as the kernel computes with them, in float64: per row and block of 32, q = x * (top / max|x|)
    rounded half to even in float32 (a block whose top / max|x| overflows is first scaled by 2^64, exactly),
    top = 127 (int8) or 32767 (int16), times the step max|x| / top."""
    top = float(2 ** (bits - 1) - 1)
    b = x.float().reshape(x.shape[0], -1, 32)
    t = b.abs().amax(-1, keepdim=True)
    tiny = torch.isinf(top / t) & (t > 0)
    b, t2 = torch.where(tiny, b * 2.0 ** 64, b), torch.where(tiny, t * 2.0 ** 64, t)
    inv = torch.where(t2 > 0, top / t2, torch.zeros_like(t2))
    q = torch.round(b * inv).clamp(-top, top)
    return (q.double() * (t / top).double()).reshape(x.shape)


def _rows_reference(layer, x, bits, scales=None, zeros=None):
    """What the family computes, in float64: int8 weights times the quantized activations; 4-bit weights
    (q - 8) * scale times the quantized activations plus each block's min (zero - 8 scale) times the block's
    sum of x itself (the kernel sums x exactly for it, as the earlier kernels did)."""
    xq = _quantized_reference(x, bits)
    if isinstance(layer, Int8Linear):
        return (xq @ layer.weight_int8.double().t()) * layer.scales.double()
    s = (layer.scales if scales is None else scales).double()
    z = (layer.zeros if zeros is None else zeros).double()
    main = (layer.unpacked().double() - 8) * s.repeat_interleave(32, 1) + 8 * s.repeat_interleave(32, 1)
    sums = x.double().reshape(x.shape[0], -1, 32).sum(-1)
    return xq @ main.t() + sums @ (z - 8 * s).t()


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("kind", ["q4", "i8"])
def test_rows_kernel_is_the_formula_on_its_quantized_activations(rows_family, bits, kind):
    """Against the layer's dequantized weight in float64 applied to the activations as the kernel quantizes
    them: float32 outputs agree to float32's rounding (the integer sums are exact), at tile counts that
    split over threads and 1-19 rows (passes of 8, 4, 2, 1); a bf16 output is the float32 one rounded."""
    for n, k in ((48, 64), (320, 1536)):
        if kind == "q4":
            layer, g = _layer(n, k, torch.bfloat16, seed=n)
        else:
            g = torch.Generator().manual_seed(n)
            layer = Int8Linear(torch.randn(n, k, generator=g).to(torch.bfloat16))
        layer.act_bits = bits
        kernel = layer.rows_kernel()
        assert kernel == f"{kind}_rows_a{bits}" and layer.kernel_candidates(16) == (kernel,)
        assert kernel in layer.kernel_candidates(17) and len(layer.kernel_candidates(17)) > 1
        w = layer.dequantized().double()
        for rows in (1, 2, 3, 8, 19):
            x = torch.randn(rows, k, generator=g)
            ref = _rows_reference(layer, x, bits)
            out = layer.run_kernel(kernel, x)
            assert out.dtype == torch.float32 and out.shape == (rows, n)
            assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (n, k, rows)
            xb = x.to(torch.bfloat16)  # the same sums from the same (exactly widened) values, rounded to bf16
            assert torch.equal(layer.run_kernel(kernel, xb), layer.run_kernel(kernel, xb.float()).to(torch.bfloat16))
            plain = xb.double() @ w.t()  # and close to the unquantized product
            err = float((layer.run_kernel(kernel, xb).double() - plain).abs().max() / plain.abs().max())
            assert err < (2e-2 if bits == 8 else 8e-3), (kind, bits, rows, err)


@pytest.mark.parametrize("bits", [8, 16])
def test_rows_kernel_a_row_is_the_same_bits_alone_and_among_others(rows_family, bits):
    """The point of the family: a row's output does not depend on the rows beside it or how many there are
    (1, 3, 8, 16, 17, 40), in bf16 and float32, 4-bit and int8 weights."""
    q4, g = _layer(64, 576, torch.bfloat16, seed=7)
    i8 = Int8Linear(torch.randn(96, 576, generator=g).to(torch.bfloat16))
    for layer in (q4, i8):
        layer.act_bits = bits
        kernel = layer.rows_kernel()
        for dtype in (torch.bfloat16, torch.float32):
            row = torch.randn(1, 576, generator=g).to(dtype)
            alone = layer.run_kernel(kernel, row)
            for rows in (3, 8, 16, 17, 40):
                others = (torch.randn(rows, 576, generator=g) * 10).to(dtype)
                at = int(torch.randint(rows, (1,), generator=g))
                others[at] = row[0]
                assert torch.equal(layer.run_kernel(kernel, others)[at], alone[0]), (kernel, dtype, rows)


def test_rows_kernel_edge_inputs(rows_family):
    """A block of zeros, a tiny block (its step would overflow), a huge value beside small ones, a
    non-contiguous input, no rows; a non-finite value makes the output non-finite; bad shapes are refused."""
    layer, g = _layer(32, 96, torch.float32, seed=5)
    # a float32 layer packs none (the plan offers the family to bf16 layers); the operator runs it all the same,
    # with the scales rounded to bf16 as the layout keeps them
    packed = pack_q4_rows(layer.unpacked(), layer.scales, layer.zeros)
    for bits in (8, 16):
        x = torch.randn(3, 96, generator=g)
        x[0, :32] = 0
        x[1, 32:64] *= 1e-38
        x[2, 70] = 2.5e4
        out = torch.ops.specdecode.q4_rows(x, packed, bits)
        ref = _rows_reference(layer, x, bits, layer.scales.bfloat16(), layer.zeros.bfloat16())
        assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
        wide = torch.randn(96, 5, generator=g).t()
        torch.testing.assert_close(torch.ops.specdecode.q4_rows(wide, packed, bits),
                                   torch.ops.specdecode.q4_rows(wide.contiguous(), packed, bits))
        assert torch.ops.specdecode.q4_rows(x[:0], packed, bits).shape == (0, 32)
        x[1, 3] = float("nan")
        assert not torch.isfinite(torch.ops.specdecode.q4_rows(x, packed, bits)[1]).any()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.specdecode.q4_rows(torch.randn(1, 40), packed, 8)
    with pytest.raises(RuntimeError, match="pack_q4_rows"):
        torch.ops.specdecode.q4_rows(torch.randn(1, 64), packed, 8)
    with pytest.raises(RuntimeError, match="activation bits must be 8 or 16"):
        torch.ops.specdecode.q4_rows(torch.randn(1, 96), packed, 4)


def test_rows_kernel_compiles_into_a_graph(rows_family):
    layer, g = _layer(32, 64, torch.bfloat16, seed=9)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    eager = layer(x)
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), eager)


@pytest.mark.parametrize(("name", "dtype"), ATTENTION_CASES)
def test_attention_kernel_a_query_depends_only_on_the_keys_it_sees(loaded, name, dtype):
    """A query that sees keys [0, p] gets the same bits over S = p + 1 keys (a token decoded alone) as over
    more keys masked past p with other queries beside it (the same token in a verify), for key counts on and
    off the kernels' blocks of 8 and 16."""
    op = attention_kernel(name)
    for p in (6, 7, 8, 15, 16, 29, 40):
        q, k, v, _ = _attention_case(1, 4, p + 9, dtype, False, seed=p)
        alone = op(q[:, :, :1].reshape(1, 3, 3, 64), k[:, :, :p + 1], v[:, :, :p + 1], None, 1)
        mask = torch.zeros(1, 4, p + 9, dtype=torch.bool)
        mask[0, 0, :p + 1] = True  # the first query: keys 0..p; the others see more
        mask[0, 1:, :] = True
        qg = q.reshape(1, 3, 3, 4, 64).reshape(1, 3, 12, 64)  # (head, token) rows, token fastest
        together = op(qg, k, v, mask, 4).reshape(1, 3, 3, 4, 64)[:, :, :, 0]
        assert torch.equal(together, alone), p


@pytest.mark.parametrize(("name", "dtype"), ATTENTION_CASES)
def test_attention_kernel_a_query_gets_its_bits_wherever_its_keys_sit(loaded, name, dtype):
    """A tree's later sibling: the token sits one slot (or more) past where it sits decoded alone, with a
    masked sibling's key between its ancestors and itself. It sees the same keys in the same order, so it
    gets the same bits (the softmax's sum by rank among the seen keys, not by slot)."""
    op = attention_kernel(name)
    for p, gaps in ((6, 1), (7, 1), (14, 3), (15, 2), (29, 1), (40, 5)):
        q, k, v, _ = _attention_case(1, 1, p + 1 + gaps, dtype, False, seed=p)
        qg = q.reshape(1, 3, 3, 64)
        alone = op(qg, k[:, :, :p + 1].contiguous(), v[:, :, :p + 1].contiguous(), None, 1)  # keys 0..p
        # the same keys with `gaps` other keys (siblings) before the last one, masked
        order = [*range(p), *range(p + 1, p + 1 + gaps), p]
        moved_k, moved_v = k[:, :, order].contiguous(), v[:, :, order].contiguous()
        mask = torch.ones(1, 1, p + 1 + gaps, dtype=torch.bool)
        mask[0, 0, p:p + gaps] = False
        assert torch.equal(op(qg, moved_k, moved_v, mask, 1), alone), (p, gaps)


@pytest.mark.parametrize(("name", "dtype"), ATTENTION_CASES)
def test_attention_kernel_rows_and_tokens_get_their_own_bits(loaded, name, dtype):
    """Each row of a batch, and each token of a 16-token verify under a tree-like mask, gets the bits it gets
    alone: the kernels split rows and queries into tasks, never sums."""
    op = attention_kernel(name)
    B, T, S = 3, 16, 60
    q, k, v, mask = _attention_case(B, T, S, dtype, True, seed=11)
    qg, rows = q.reshape(B, 3, 3, T, 64).reshape(B, 3, 3 * T, 64), mask.reshape(B, T, S)
    together = op(qg, k, v, rows, T).reshape(B, 3, 3, T, 64)
    for b in range(B):
        assert torch.equal(op(qg[b:b + 1], k[b:b + 1], v[b:b + 1], rows[b:b + 1], T).reshape(1, 3, 3, T, 64),
                           together[b:b + 1]), b
        for t in (0, 5, 15):
            alone = op(q[b:b + 1, :, t:t + 1].reshape(1, 3, 3, 64), k[b:b + 1], v[b:b + 1], rows[b:b + 1, t:t + 1], 1)
            assert torch.equal(alone, together[b:b + 1, :, :, t]), (b, t)
