"""Compiled target and draft steps (``Transformer.step``, a drafter's ``step``), one graph per bucket.

Decode and verify calls (few tokens per row) are padded to a small set of shapes (rows, tokens
per row, attention span) so one compiled graph serves every step of a bucket: positions, cache
slots and the mask are data, and the span follows the context in powers of two, so attention
costs what the real context needs, not the model's maximum. A stored graph (CPU) takes the span
and the cache size as dynamic dimensions: one graph per rows and tokens serves them all; under
``torch.compile`` (CUDA graphs) each span is its own graph. Padding tokens write to the cache's
scratch slot and are masked out; padding queries see key 0 only (a finite softmax). Prefill
chunks (more tokens) stay eager.

More in docs/compiled.md.
"""

from __future__ import annotations

import functools
import time
import types
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch._dynamo
from torch import Tensor, nn

from specdecode.core.attention import resolve_call
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.kvcache import KVCache
from specdecode.core.model import ForwardOutput, Transformer
from specdecode.core.quant import QuantizedDispatch
from specdecode.core.requests import check_context
from specdecode.core.runner import EAGER, Drafter, StepRunner
from specdecode.core.speculative import SpecConfig

COMPILE_MODES = ("auto", "on", "off")
ROW_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # capped by the pool's rows
TOKEN_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)
MIN_SPAN = 256


def check_compile_mode(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The first bucket >= n (n itself beyond the last)."""
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def span_bucket(span: int, limit: int) -> int:
    """Attention span for ``span`` keys: the next power of two from MIN_SPAN, at most ``limit`` (a
    cache's size: caches of compiled models are bucket-sized, ``CompiledRunner.capacity``)."""
    s = MIN_SPAN
    while s < span:
        s *= 2
    return min(s, limit)


@functools.cache  # asked at every draft call: the answer is the machine's
def inductor_packs(dtype: torch.dtype, device_type: str) -> bool:
    """Whether inductor's freezing packs a plain linear layer of ``dtype`` for oneDNN; where it does not
    (bf16 on a CPU without bf16 instructions: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False),
    a graph runs aten's matmul where the eager kernel plan chose oneDNN. A drafter's layers are plain
    (never quantized), so its steps then run eager: on an AVX2-only EPYC its graphs were slower than eager
    for the draft steps and the re-extend (docs/LOG.md). The target's 4-bit and int8 kernels are ops the
    graph keeps, so it compiles regardless."""
    if device_type != "cpu":
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def draft_graphs_pay(drafter: Eagle3Drafter, device_type: str) -> bool:
    """Whether a drafter's steps run compiled: its layers in integer kernels (ops the graph keeps, as the
    target's), or float layers that inductor packs (``inductor_packs``)."""
    return isinstance(drafter.lm_head, QuantizedDispatch) or inductor_packs(drafter.dtype, device_type)


def padded_rows(rows: int, room: int) -> int:
    """The rows a step of ``rows`` runs (a ROW_BUCKETS size), as far as the ``room`` the pool has."""
    return max(rows, min(bucket(rows, ROW_BUCKETS), room))


def span_buckets(max_len: int, limit: int) -> list[int]:
    """Every span a context of up to ``max_len`` tokens may be given (``span_bucket``) in a cache of
    ``limit`` tokens: MIN_SPAN, twice that, ... up to the first that holds ``max_len``, at most ``limit``."""
    spans, span = [], MIN_SPAN
    while True:
        spans.append(min(span, limit))
        if span >= min(max_len, limit):
            return spans
        span *= 2


@dataclass(frozen=True)
class GraphKey:
    rows: int
    tokens: int
    span: int  # 0: any (a stored graph's span and cache slots are dynamic dimensions)
    kind: str  # "target[taps]" or "draft[hidden width]"
    cache: tuple[int, ...] = ()  # a layer's cache tensor past the rows: [kv heads, slots + 1 (0: any), head dim]
    owner: int = 0  # id() of the module whose weights the graph holds: drafters sharing these steps never share graphs

    def __str__(self) -> str:
        if not self.span:
            return f"{self.kind} rows={self.rows} tokens={self.tokens} (any span)"
        return f"{self.kind} rows={self.rows} tokens={self.tokens} span={self.span} cache={self.cache[1:2]}"


def span_dynamic_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``torch.export``'s ``dynamic_shapes`` for a step's ``args`` (tokens, positions, slots, mask, ks,
    vs, extra...): the mask's keys and the cache's slots vary, so one graph serves every span and
    cache size of its rows and tokens. Measured (SmolLM2, 4-bit, one decode row): within 2% of a graph
    per span at 256 to 1024 keys, bit-identical to eager (docs/LOG.md, 2026-12-06 night)."""
    from torch.export import Dim  # torch.export's import is heavy; a graph is built rarely

    span, slots = Dim("span", min=2), Dim("slots", min=3)
    ks, vs = args[4], args[5]
    return (None, None, None, {3: span}, [{2: slots}] * len(ks), [{2: slots}] * len(vs), *(None,) * len(args[6:]))


class GraphStore(Protocol):
    """Compiled graphs kept between processes (``runtime.graphstore.PackageStore``): ``load`` gives
    the stored graph of ``module``'s weights for ``key`` or None (``step``: the module the graph was
    exported from, whose live tensors a graph without its own weight copy is bound to); ``build``
    compiles ``step`` (a module calling ``module``'s step) on example ``args``, stores and returns it;
    ``names`` lists the graphs stored for ``module``'s weights."""

    def load(self, module: nn.Module, key: GraphKey, step: nn.Module) -> Callable[..., Any] | None: ...

    def build(self, module: nn.Module, key: GraphKey, step: nn.Module, args: tuple[Any, ...],
              dynamic_shapes: tuple[Any, ...] | None = None) -> Callable[..., Any]: ...

    def names(self, module: nn.Module) -> list[str]: ...


class TargetStep(nn.Module):
    """``Transformer.step`` with fixed taps, as a module (what ``torch.export`` takes)."""

    def __init__(self, model: Transformer, taps: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.taps = model, taps

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, ks: list[Tensor],
                vs: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        return self.model.step(tokens, positions, slots, mask, ks, vs, self.taps)


class DraftStep(nn.Module):
    """A drafter's ``step`` (``core.drafter.Eagle3Drafter``) with the compiled steps' argument order."""

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, ks: list[Tensor],
                vs: list[Tensor], hidden: Tensor) -> tuple[Tensor, Tensor]:
        return self.drafter.step(tokens, hidden, positions, slots, mask, ks, vs)  # type: ignore[no-any-return]


@dataclass
class CompiledRunner:
    """A ``core.runner.StepRunner`` that runs calls of few tokens per row through compiled graphs: a
    driver is given it when built (``runtime.decoders`` passes the session's). One per model."""

    device_type: str = "cpu"
    max_tokens: int = TOKEN_BUCKETS[-1]
    on_compile: Callable[[GraphKey, float | None], None] | None = None  # (key, None) before, (key, s) after
    compile: bool = True  # False: the same padded steps run eager (batch invariance without compiling)
    # Batch invariance: every step of a batching pool runs all its rows (padding rows write the scratch
    # slot), so a request's rows see the same shapes, and kernels, whatever else is in the batch.
    fixed_rows: bool = False
    store: GraphStore | None = None  # graphs kept on disk between processes (CPU: AOTInductor packages)
    build: bool = True  # False: only the store's graphs run compiled, other buckets' padded steps eager
    graphs: dict[GraphKey, Callable[..., Any]] = field(default_factory=dict)
    # the padded steps run eager (not compiling, or a shape neither stored nor built): apart, so a later
    # build, or a copy that builds (stored_only shares ``graphs``), still builds the shape
    eager: dict[GraphKey, nn.Module] = field(default_factory=dict)
    compiled: list[tuple[GraphKey, float]] = field(default_factory=list)  # (key, seconds) in order
    loaded: list[GraphKey] = field(default_factory=list)  # graphs taken from the store, in order
    ran: set[GraphKey] | None = None  # while a driver warms (``recording``): every bucket a call ran

    def mixes(self, keys: set[GraphKey]) -> bool:
        """Whether of the buckets ``keys`` some run a graph and others their padded step eager: the two round
        bf16 differently, so a driver's row would get other tokens in a batch than alone (issue 66)."""
        graphs = sum(k in self.graphs for k in keys)
        return 0 < graphs < len(keys) and self.compile

    def serves(self, batch: int, tokens: int, drafter: Any = None) -> bool:
        """Whether a call of ``tokens`` per row runs here (a ``drafter``'s: an EAGLE-3 head, where its graphs
        pay); other calls (prefill chunks, a self-drafter's) run the module's own forward."""
        return (tokens <= self.max_tokens and not torch.is_grad_enabled()
                and (drafter is None
                     or (isinstance(drafter, Eagle3Drafter) and draft_graphs_pay(drafter, self.device_type))))

    def capacity(self, max_len: int) -> int:
        """A cache's size rounded up to a span bucket, so requests of similar lengths share graphs."""
        return span_bucket(max_len, max(max_len, MIN_SPAN) * 2)

    def target(self, model: Transformer, tokens: Tensor, positions: Tensor, cache: KVCache,
               attention_mask: Tensor | None = None, hidden_layers: Sequence[int] = (),
               logits_at: Tensor | None = None, slots: Tensor | None = None) -> ForwardOutput:
        """``model.forward``'s call: ``model.step`` padded to its bucket's graph where ``serves``, else eager."""
        B, T = tokens.shape
        if not self.serves(B, T):
            return model(tokens, positions, cache, attention_mask, hidden_layers, logits_at, slots)
        taps = model.taps(hidden_layers)
        start, mask = resolve_call(cache, B, T, attention_mask, slots, True, tokens.device)
        assert isinstance(start, Tensor) and mask is not None
        logits, hidden = self._target(model, tokens, positions.expand(B, T), start, mask, cache, taps)
        if slots is None:
            cache.advance(T)
        return ForwardOutput(logits if logits_at is None else logits[:, logits_at], hidden)

    def draft(self, drafter: Drafter, tokens: Tensor, hidden: Tensor, positions: Tensor, cache: KVCache,
              attention_mask: Tensor | None = None, slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A drafter's call the same way (an EAGLE-3 head's ``step``): one graph per bucket and hidden width
        (the target's fused taps, or the draft's own state)."""
        B, T = tokens.shape
        if not self.serves(B, T, drafter):
            return drafter(tokens, hidden, positions, cache, attention_mask, slots)
        start, mask = resolve_call(cache, B, T, attention_mask, slots, True, tokens.device, "draft cache")
        assert isinstance(start, Tensor) and mask is not None
        logits, h = self._draft(drafter, tokens, hidden, positions.expand(B, T), start, mask, cache)
        if slots is None:
            cache.advance(T)
        return logits, h

    def _target(self, model: Transformer, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                cache: KVCache, taps: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        """``model.step`` over these inputs (the static form), padded to their bucket's graph."""
        logits, hidden = self._run(f"target{list(taps)}", model, lambda: TargetStep(model, taps), tokens, positions,
                                   slots, mask, cache, ())
        return logits, list(hidden)

    def _draft(self, drafter: Any, tokens: Tensor, hidden: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
               cache: KVCache) -> tuple[Tensor, Tensor]:
        logits, h = self._run(f"draft[{hidden.shape[-1]}]", drafter, lambda: DraftStep(drafter), tokens, positions,
                              slots, mask, cache, (hidden,))
        return logits, h

    def _run(self, kind: str, owner: nn.Module, make: Callable[[], nn.Module], tokens: Tensor, positions: Tensor,
             slots: Tensor, mask: Tensor, cache: KVCache, extra: tuple[Tensor, ...]) -> Any:
        B, T = tokens.shape
        S = mask.shape[-1]
        pool, row0 = (cache.parent, cache.row0) if cache.parent is not None else (cache, 0)
        if self.fixed_rows:  # the whole pool, these rows at their own place in it
            Bp, at = pool.batch_size, row0
        else:
            Bp, at = padded_rows(B, pool.batch_size - row0), 0  # padding: the pool's next rows
        Tp = bucket(T, TOKEN_BUCKETS)
        # A pool's rows (a driver's, a request alone being a one-row pool) attend a span that follows the
        # longest row's context in powers of two; a plain cache (a direct call) is attended whole. Keys
        # [0, Sp): never the scratch slot.
        Sp = span_bucket(S, cache.max_len) if pool.batch_size > 1 or cache.parent is not None else cache.max_len
        view = pool.rows(row0 - at, row0 - at + Bp) if Bp != B else cache
        # always fresh contiguous inputs: strides are part of what a graph was compiled for
        tokens, positions, slots, mask = _pad(tokens, positions, slots, mask.view(B, 1, T, S), Bp, Tp, Sp,
                                              scratch=cache.max_len, at=at)
        extra = tuple(_pad_rows(x, Bp, Tp, at) for x in extra)
        cache_shape = tuple(view.k[0].shape[1:]) if view.k else ()
        if self.store is not None:  # stored graphs serve every span and cache size (span_dynamic_shapes)
            Sp_key, cache_shape = 0, tuple(0 if i == 1 else d for i, d in enumerate(cache_shape))
        else:  # torch.compile (CUDA graphs on CUDA): a graph per span
            Sp_key = Sp
        key = GraphKey(Bp, Tp, Sp_key, kind, cache_shape, id(owner))
        if self.ran is not None:  # only while a driver warms: not on every step of the decode loop
            self.ran.add(key)
        args = (tokens, positions, slots, mask, view.k, view.v, *extra)
        fn = self.graphs.get(key)
        building = self.compile and self.build
        if fn is None and not building:  # a shape already found unstored: no look at the store each step
            fn = self.eager.get(key)
        if fn is None and self.compile and self.store is not None:
            fn = self.store.load(owner, key, make())
            if fn is not None:
                self.graphs[key] = fn
                self.loaded.append(key)
        if fn is None and not building:
            fn = self.eager[key] = make()
        if fn is None:
            if self.on_compile is not None:
                self.on_compile(key, None)
            t0 = time.perf_counter()
            if self.store is not None:  # compiled whole before its first call
                fn = self.graphs[key] = self.store.build(owner, key, make(), args, span_dynamic_shapes(args))
            else:  # torch.compile: compiled by the first call
                fn = self._compile(make(), key)
            out = self._call(fn, args, view)
            seconds = time.perf_counter() - t0
            self.compiled.append((key, seconds))
            if self.on_compile is not None:
                self.on_compile(key, seconds)
        else:
            out = self._call(fn, args, view)
        if (Bp, Tp) == (B, T):
            return out
        return tuple(x[at:at + B, :T] if isinstance(x, Tensor) else [t[at:at + B, :T] for t in x] for x in out)

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], view: KVCache) -> Any:
        """One step. Under CUDA graphs (``torch.compile`` on CUDA) the cache tensors the step writes in
        place get static addresses (``mark_static_address``): otherwise inductor skips CUDA graphs for
        the whole step ("skipping cudagraphs due to mutated inputs", every graph of the first H200
        run: ``benchmarks/results/gpu/second-run-h200``). A replay reuses its output buffers, so the
        outputs are copied out before anything else runs."""
        if self.device_type != "cuda" or not self.compile or self.store is not None:
            return fn(*args)
        mark_static(view)
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        out = fn(*args)
        return tuple(x.clone() if isinstance(x, Tensor) else [t.clone() for t in x] for x in out)

    def _compile(self, module: nn.Module, key: GraphKey) -> Callable[..., Any]:
        configure_inductor(self.device_type)

        def step(*args: Any) -> Any:
            return module(*args)

        # Each graph gets its own code object: dynamo keeps its cache per code object and checks the
        # entries' guards one after another on every call, so buckets sharing one would slow each
        # other's steps as their number grows.
        code = step.__code__.replace(co_name=f"{step.__code__.co_name}_{len(self.graphs)}")
        step = types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)
        if self.device_type == "cuda":
            fn = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
        else:
            fn = torch.compile(step, fullgraph=True, dynamic=False)
        self.graphs[key] = fn
        return fn


    def warm(self, model: Transformer, drafter: Any, prompt_len: int, max_new_tokens: int,
             spec: SpecConfig | None) -> int:
        """Compile now every graph a request alone of ``prompt_len`` tokens and ``max_new_tokens`` needs
        (plain decoding, or EAGLE-3 with ``spec``: verify, re-extend, tree steps), on scratch caches of the
        sizes its own will have (a batch of one row, ``core.engine.Engine.batch_for``), for every span it
        reaches; returns how many graphs were compiled. A benchmark calls it before timing, so no measured
        request waits for the compiler."""
        before = len(self.compiled)
        need = check_context(prompt_len, max_new_tokens, model.config.max_position_embeddings,
                             spec.margin if spec else 0)
        with torch.inference_mode():
            pool = model.new_cache(1, self.capacity(need))
            dpool = drafter.new_cache(self.capacity(need + spec.draft_scratch)) if spec is not None else None
            for span in span_buckets(need, pool.max_len):
                self.warm_rows(model, drafter, pool.rows(0, 1), dpool.rows(0, 1) if dpool is not None else None,
                               span, spec, () if spec is None else None)
        return len(self.compiled) - before

    def warm_rows(self, model: Transformer, drafter: Any, cache: KVCache, dcache: KVCache | None, span: int,
                  spec: SpecConfig | None, plain: tuple[int, ...] | None, catch_up: bool = False) -> None:
        """One call of every step that rows decoding over ``cache`` (a request's own cache, or a
        pool's first rows) with contexts of up to ``span`` keys make: a plain step with the target's
        taps ``plain`` (None: no plain steps); with ``spec``, a verify and the drafter's steps over
        ``dcache`` (re-extends of 1 to depth + 1 tokens, or with ``catch_up`` of every token bucket:
        the pairs plain steps left pending; tree levels). Each compiles (or loads) its graph if it has
        none. The calls write their scratch keys at slots 0.. of the rows: call it on caches no
        request holds yet."""
        B = cache.batch_size
        with torch.inference_mode():
            if plain is not None:
                self._target(model, *dummy_inputs(B, 1, span, model.device), cache, plain)
            if spec is None:
                return
            assert dcache is not None, "speculative steps draft over a drafter's cache"
            taps = tuple(drafter.config.aux_layer_ids)
            # a verify of the head's tree, and of the tree with an n-gram proposal's nodes (``SpecConfig.ngram``)
            for t in sorted({bucket(n, TOKEN_BUCKETS) for n in range(spec.num_draft_tokens, spec.max_tree + 1)}):
                self._target(model, *dummy_inputs(B, t, span, model.device), cache, taps)
            if not draft_graphs_pay(drafter, self.device_type):
                return  # its steps run eager (``serves``)
            width = len(taps) * model.config.hidden_size
            extends = TOKEN_BUCKETS if catch_up else {bucket(t, TOKEN_BUCKETS) for t in range(1, spec.max_depth + 2)}
            calls = [(t, width) for t in sorted(extends) if t <= self.max_tokens]
            if spec.num_steps > 1:
                calls.append((spec.topk, drafter.config.hidden_size))
            for t, w in calls:
                hidden = torch.zeros(B, t, w, dtype=model.dtype, device=model.device)
                tokens, positions, slots, mask = dummy_inputs(B, t, min(span, dcache.max_len), model.device)
                self._draft(drafter, tokens, hidden, positions, slots, mask, dcache)


def mark_static(cache: KVCache) -> None:
    """The cache's tensors keep their addresses from call to call (a pool's rows are views of tensors
    allocated once): CUDA graphs may then write them in place. A view made later carries no mark of
    its own, so this runs before every compiled call; it only sets an attribute."""
    for t in (*cache.k, *cache.v):
        torch._dynamo.mark_static_address(t)


def dummy_inputs(B: int, T: int, S: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """B rows of T tokens at positions and slots 0..T-1 of their caches, attending causally within
    them, with a mask S keys wide (a pool's steps are given the span their longest row needs)."""
    ids = torch.arange(T, device=device)[None].expand(B, T).contiguous()
    mask = torch.zeros(B, 1, T, max(S, T), dtype=torch.bool, device=device)
    mask[..., :T] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return ids, ids, ids, mask


def _pad_rows(x: Tensor, Bp: int, Tp: int, at: int = 0) -> Tensor:
    out = x.new_zeros(Bp, Tp, *x.shape[2:])
    out[at:at + x.shape[0], :x.shape[1]] = x
    return out


def _pad(tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, Bp: int, Tp: int, Sp: int,
         scratch: int, at: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """New contiguous inputs of the bucket's shape, the given rows from row ``at``: padding tokens at
    position 0 write the scratch slot, padding queries see key 0 only."""
    B, T = tokens.shape
    S = mask.shape[-1]
    dev = tokens.device
    t = torch.zeros(Bp, Tp, dtype=torch.long, device=dev)
    p = torch.zeros(Bp, Tp, dtype=torch.long, device=dev)
    s = torch.full((Bp, Tp), scratch, dtype=torch.long, device=dev)
    m = torch.zeros(Bp, 1, Tp, Sp, dtype=torch.bool, device=dev)
    m[:, :, :, 0] = True  # padding queries see key 0 only (no empty softmax)
    t[at:at + B, :T], p[at:at + B, :T], s[at:at + B, :T] = tokens, positions, slots
    m[at:at + B, :, :T, :S] = mask
    return t, p, s, m


_configured: set[str] = set()

# Inductor options of every compiled step, ``torch.compile``'s and the stored packages' alike.
# ``emulate_precision_casts``: a fused kernel rounds each intermediate to the model's dtype where eager
# would, so a bf16 row gets the same bits in every graph (a verify's k tokens, a batch's rows, a graph
# with taps as one without) and greedy speculative output equals plain decoding (issue 47: without it,
# 5/13 Spec-Bench prompts stayed identical with stored graphs; benchmarks/results/q4-speculation).
INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"freezing": True, "cpp_wrapper": True, "emulate_precision_casts": True},
    "cuda": {"emulate_precision_casts": True},
}


def configure_inductor(device_type: str) -> None:
    """Inductor settings for compiled steps, set once: ``INDUCTOR_OPTIONS`` (on CPU freezing and the
    C++ wrapper, see the module docstring), one cache entry per bucket (the default recompile limit of 8 is below the
    number of buckets a server meets)."""
    if device_type in _configured:
        return
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    for name, value in INDUCTOR_OPTIONS.get(device_type, {}).items():
        setattr(inductor_config, name, value)
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    _configured.add(device_type)


def stored_only(runner: StepRunner) -> StepRunner:
    """What a measurement of the run's own steps times without compiling anything now: ``runner``'s
    stored graphs (loaded, shared with ``runner``), the other buckets' padded steps eager; eager where
    ``runner`` keeps no store (eager steps, or CUDA graphs captured in each process)."""
    if not isinstance(runner, CompiledRunner) or not runner.compile or runner.store is None:
        return EAGER
    return replace(runner, build=False, eager={})


def fixed_rows(runner: StepRunner, device_type: str) -> CompiledRunner:
    """``runner`` over a pool's every row (batch invariance, ``CompiledRunner.fixed_rows``): a compiled
    runner's copy (its graphs shared), else the same padding run eager."""
    if isinstance(runner, CompiledRunner):
        return replace(runner, fixed_rows=True)
    return CompiledRunner(device_type, compile=False, fixed_rows=True)
