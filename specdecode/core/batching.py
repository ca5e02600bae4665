"""Continuous batching: many requests decoded together, each exactly as if alone.

A ``BatchEngine`` keeps up to ``slots`` requests in one preallocated KV pool (the target's
and the drafter's). Pool rows ``[0, decoding)`` decode, rows ``[decoding, active)`` wait for
or are in prefill; a request that leaves takes its place back by moving the last row of its
block into it (one copy of that row's cache), so every batched forward runs over a
contiguous block of rows with per-row lengths (``Transformer.forward(slots=...)``).

More in docs/serving.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from specdecode.core.attention import rows_mask
from specdecode.core.compiled import CompiledRunner, GraphKey, fixed_rows, padded_rows, span_buckets
from specdecode.core.kvcache import KVCache
from specdecode.core.model import Transformer
from specdecode.core.ngram import NgramIndex
from specdecode.core.prefixcache import BLOCK, PrefixCache
from specdecode.core.profiler import PHASES, CycleRecord, PhaseClock, SpecProfile, TimeMeter
from specdecode.core.requests import (
    GenerateOptions,
    StreamChunk,
    TextAssembler,
    TokenIdsOnly,
    Tokenizer,
    check_context,
)
from specdecode.core.runner import EAGER, Drafter, StepRunner
from specdecode.core.sampling import greedy_argmax, sample
from specdecode.core.specpolicy import (
    CALIBRATION_ROUNDS,
    CALIBRATION_SPREAD,
    CALIBRATION_STEPS,
    SPEC_POLICIES,
    SpecPolicy,
    SpecPolicyName,
)
from specdecode.core.speculative import (
    ShapePolicy,
    SpecConfig,
    SpecRow,
    TreeBudget,
    extend_rows,
    prefill,
    spec_cycle,
    spec_margin,
    start_draft,
)

# Under 'auto', plain steps still collect the target's taps so the drafter can catch up when
# speculation resumes; past this many pending pairs a row's drafter catches up anyway.
MAX_PENDING_PAIRS = 32


class BatchFullError(RuntimeError):
    """Every slot is taken: retry when a request finishes."""


# contexts (prompt + new tokens) compiled graphs are made for at least (`serve`, `specdecode compile`, the build a run
# starts in the background): longer ones run eager
DEFAULT_COMPILE_MAX_LEN = 1024

@dataclass(frozen=True)
class BatchConfig:
    slots: int = 8  # requests decoded together at most
    slot_tokens: int | None = None  # prompt + new tokens per request; None: the model's context
    prefill_chunk: int = 256  # prompt tokens prefilled per step
    spec_policy: SpecPolicyName = "auto"
    # Every step runs all the pool's rows (padding rows write a scratch slot), so a request's tokens do
    # not depend on what else is batched, in any dtype; the policy must then be one mode for every batch
    # size ('always' or 'never'). Measured cost: benchmarks/tools/reproducibility.py.
    batch_invariant: bool = False
    # Prompt tokens whose keys and values are kept for later prompts that start the same way
    # (``core.prefixcache``); None: half the pool's tokens (slots x slot tokens: a slot holds a prompt and
    # its answer, the cache prompts only); 0: off.
    prefix_cache: int | None = None

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.slot_tokens is not None and self.slot_tokens < 2:
            raise ValueError(f"slot_tokens must be >= 2, got {self.slot_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefix_cache is not None and (self.prefix_cache < 0 or 0 < self.prefix_cache < BLOCK):
            raise ValueError(f"prefix_cache must be 0 (off) or at least one block of {BLOCK} tokens, "
                             f"got {self.prefix_cache}")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {', '.join(SPEC_POLICIES)}; got {self.spec_policy!r}")
        if self.batch_invariant and self.spec_policy not in ("always", "never"):
            raise ValueError(f"a batch-invariant engine decodes every batch size one way: spec_policy 'always' or "
                             f"'never', not {self.spec_policy!r} (plain and speculative steps round differently)")


@dataclass(eq=False, kw_only=True)
class _Row(SpecRow):
    """A request in the batch: its speculative row (``SpecRow``: cache lengths, root, what the
    drafter has yet to see) and what the engine adds (prompt, options, text, timing)."""
    key: Hashable
    prompt: list[int]
    options: GenerateOptions
    text: TextAssembler
    arrived: float
    cached: int = 0  # prompt tokens copied from the prefix cache, not computed
    profile: SpecProfile = field(default_factory=SpecProfile)


@dataclass
class Finished:
    """A request that left the batch: why, and its speculative record."""

    key: Hashable
    finish_reason: str  # "stop" | "length" | "cancelled"
    generated: int
    profile: SpecProfile


@dataclass
class StepReport:
    """What one ``step()`` did."""

    events: list[tuple[Hashable, StreamChunk]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0  # the prefill chunk's time, its first token's sampling and draft start included
    batch: int = 0  # rows in the decode step (0: none ran)
    speculative: bool = False
    tokens: int = 0  # tokens generated by the decode step, all rows
    seconds: float = 0.0  # the decode step's time (prefill excluded)
    phases: dict[str, float] = field(default_factory=dict)
    cycles: list[CycleRecord] = field(default_factory=list)  # speculative: one per row (times: ``phases``)

    def cycle_records(self) -> list[CycleRecord]:
        """Each row's cycle with the step's phase times (the time every row of the batch waited)."""
        times = {**self.phases, "total": sum(v for k, v in self.phases.items() if k in PHASES)}  # not host, calls
        return [replace(r, times=times) for r in self.cycles]


class BatchEngine:
    """Continuous batching over one model (and optionally a drafter); not thread-safe: one
    thread calls ``add``, ``remove`` and ``step``."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, drafter: Drafter | None = None,
                 spec: SpecConfig | None = None, config: BatchConfig = BatchConfig(), *,
                 adapt: ShapePolicy | None = None, sync: bool = True, comm: TimeMeter | None = None,
                 runner: StepRunner = EAGER, budget: TreeBudget | None = None) -> None:
        """``adapt``: re-chooses the shape after every speculative step from each row's acceptance (the
        caches are sized for its largest shape); ``sync`` and ``comm``: the phase clock's (``PhaseClock``);
        ``runner``: how the target's and the drafter's steps run (eager, or compiled graphs); ``budget``: how
        much of each cycle's trees to verify (``core.prune``; None: all)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.drafter = drafter if spec is not None else None
        self.spec = spec if drafter is not None else None  # the next speculative step's shape
        self.adapt = adapt if self.spec is not None else None
        self.shapes = [self.spec, *(self.adapt.shapes if self.adapt else ())] if self.spec is not None else []
        self.sync, self.comm, self.budget = sync, comm, budget
        self.policy = SpecPolicy(config.spec_policy, self.spec is not None)
        self.drafting = self.policy.name != "never"  # rows keep the drafter in step
        # Tokens per slot, speculative slots included: a request fits when prompt + new tokens
        # + margin <= limit (the same rule as a request decoded alone, ``check_context``).
        context = model.config.max_position_embeddings
        if config.slot_tokens is not None and config.slot_tokens > context:
            raise ValueError(f"slot tokens ({config.slot_tokens}, --context-length) exceed the model's context of "
                             f"{context} tokens; use at most {context}")
        self.limit = config.slot_tokens or context
        self.margin = spec_margin(self.shapes) if self.drafting else 0
        # batch-invariant: every step over the whole pool (EAGLE-3's drafts too: they then do not change with
        # the batch either; the output would not anyway, being the target's choice per token at fixed shapes)
        self.runner = fixed_rows(runner, model.device.type) if config.batch_invariant else runner
        self.mixed_steps = False  # warm found some steps stored and others not, and runs them all eager
        self._pools: tuple[KVCache, KVCache | None] | None = None
        tokens = config.prefix_cache if config.prefix_cache is not None else config.slots * self.limit // 2
        self.prefix_tokens = tokens if tokens >= BLOCK else 0  # the prefix cache's size (0: none)
        self._prefix: PrefixCache | None = None  # made with the pools (``allocate``)
        self.rows: list[_Row] = []
        self.decoding = 0  # rows [0, decoding) decode; the rest wait for (or are in) prefill

    def allocate(self) -> None:
        """Allocate the KV pools now (else at the first request). On CPU, call it from the thread
        that steps: filling a large tensor starts an OpenMP team in the calling thread, and a
        second team on the same cores throttles both (``runtime.session.on_passing_thread``)."""
        if self._pools is None:
            # sized for the runner (a compiled one rounds them to its buckets)
            tpool = self.model.new_cache(self.config.slots, self.runner.capacity(self.limit))
            dpool = None
            if self.drafting and self.drafter is not None and self.shapes:
                extra = max(s.draft_scratch for s in self.shapes)
                dpool = self.drafter.new_cache(self.runner.capacity(self.limit + extra), self.config.slots)
            if self.prefix_tokens:  # whole prefill chunks only: a repeat computes what the first request did
                self._prefix = PrefixCache(self.prefix_tokens, tpool, aligned=self.config.prefill_chunk,
                                           taps=self._taps_width())
            self._pools = tpool, dpool

    def _taps_width(self) -> int:
        """Values per position of the target's taps the drafter reads (0: it reads none)."""
        return len(self._aux()) * self.model.config.hidden_size

    def warm(self, max_len: int | None = None, on_span: Callable[[int, int], None] | None = None,
             seal: bool = False) -> int:
        """Compile now (or load from their store) the graphs of this engine's decode steps when the
        model runs compiled steps (``core.compiled.CompiledRunner``): every batch size bucket up to the
        slots (the whole pool when batch-invariant), every attention span for contexts of up to
        ``max_len`` tokens (default: the slot limit), the plain and speculative steps the policy may
        take. Prefill chunks stay eager. ``on_span(i, n)`` hears progress by span. ``seal``: then
        compile nothing more (a shape not warmed runs its padded step eager), so that no request of a
        server waits minutes for the compiler. Call it before any request, on the thread that steps;
        returns how many graphs were compiled (0: eager steps). Sealed with some of those steps stored and
        others not (a store holding ``generate``'s one-row graphs), every step runs eager from then on
        (``mixed_steps``): a graph and an eager step round bf16 differently, and a request must get the same
        tokens in any batch as alone."""
        steps = self.runner
        if not isinstance(steps, CompiledRunner) or not steps.compile or self.rows:
            return 0
        self.allocate()
        assert self._pools is not None
        tpool, dpool = self._pools
        slots = self.config.slots
        sizes = [slots] if steps.fixed_rows else sorted({padded_rows(b, slots) for b in range(1, slots + 1)})
        spans = span_buckets(max_len or self.limit, tpool.max_len)
        plain = None if self.policy.name == "always" else self._aux()
        spec = self.spec if self.drafting else None
        before = len(steps.compiled)
        ran: set[GraphKey] = set()
        steps.ran = ran  # the buckets these steps run, recorded while warming
        try:
            for i, span in enumerate(spans):
                if on_span is not None:
                    on_span(i, len(spans))
                for b in sizes:
                    steps.warm_rows(self.model, self.drafter, tpool.rows(0, b),
                                    dpool.rows(0, b) if dpool is not None else None, span, spec, plain,
                                    catch_up=plain is not None)
        finally:
            steps.ran = None
        if on_span is not None:
            on_span(len(spans), len(spans))
        if seal:
            steps.build = False
            if steps.mixes(ran):  # some batch sizes compiled, others eager: every step eager instead
                self.run_eager()
        return len(steps.compiled) - before

    def run_eager(self) -> None:
        """Every step eager from now on: where some of this engine's steps would run a graph and others eager, a
        request's tokens would depend on the batch it is in (``warm``)."""
        self.runner = fixed_rows(EAGER, self.model.device.type) if self.config.batch_invariant else EAGER
        self.mixed_steps = True

    def check_calibration(self, prompt_tokens: int, steps: int = CALIBRATION_STEPS) -> None:
        """Refuse (ValueError) slots too short for ``calibrate``: its prompt, then an untimed and ``steps``
        timed steps of each mode, a speculative one adding up to the margin's tokens and its bonus."""
        need = prompt_tokens + self.margin + (steps + 1) * (self.margin + 2)
        if self.policy.name == "auto" and need > self.limit:
            raise ValueError(f"requests of {self.limit} tokens leave no room for spec policy auto's start-up timing "
                             f"(its prompt of {prompt_tokens} tokens and {steps} steps of each mode need {need}): "
                             f"allow at least {need} tokens per request (serve --context-length), or choose the "
                             f"mode (--spec-policy never or always)")

    @torch.inference_mode()  # as ``step``: else the model's compiled steps stand aside and eager ones are timed
    def calibrate(self, prompt_ids: Sequence[int], steps: int = CALIBRATION_STEPS) -> dict[int, bool]:
        """'auto': time plain and speculative steps (alternating, the median of ``steps`` each) at every
        batch size bucket up to the slots, on rows that all decode ``prompt_ids`` (greedy), and fix the
        choice per bucket; then the pool is empty again. Call it before any request (``serve`` does, on
        its worker thread); a no-op for the other policies. Returns bucket -> speculate."""
        if self.policy.name != "auto" or self.rows:
            return dict(self.policy.calibrated)
        self.check_calibration(len(prompt_ids), steps)
        options = GenerateOptions(max_new_tokens=self.limit - len(prompt_ids) - self.margin, stop_token_ids=())
        self.check(len(prompt_ids), options)
        buckets, b = [], 1
        while b < self.config.slots:
            buckets.append(b)
            b *= 2
        buckets.append(self.config.slots)
        for b in buckets:
            for i in range(b):
                self.add(("calibrate", i), prompt_ids, options)
            while self.decoding < b:
                self._prefill_chunk(StepReport())
            self._plain_step(StepReport())  # untimed: a batch size's first steps build kernels for its shapes
            self._spec_step(StepReport())
            fastest = {False: math.inf, True: math.inf}
            tokens, spec_steps = 0, 0
            for _ in range(CALIBRATION_ROUNDS):
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(steps):
                    for spec in (False, True):
                        report = StepReport()
                        t0 = time.perf_counter()
                        (self._spec_step if spec else self._plain_step)(report)
                        times[spec].append(time.perf_counter() - t0)
                        tokens += report.tokens if spec else 0
                spec_steps += steps
                spread = max(statistics.median(t) / min(t) for t in times.values())
                for spec, t in times.items():
                    fastest[spec] = min(fastest[spec], *t)
                room = self.limit - self.margin - max(self.tpool.lengths[:len(self.rows)]) - 1
                if spread <= CALIBRATION_SPREAD or room < steps * (self.margin + 2):
                    break  # steady, or no room left in the rows for another round
            self.policy.decide(b, fastest[False], fastest[True], tokens / spec_steps)
            self.policy.calibrated_spread[b] = spread
            for i in range(b):
                self.remove(("calibrate", i))
        if self._prefix is not None:  # requests start from an empty cache, its counts theirs alone
            self._prefix.clear()
        return dict(self.policy.calibrated)

    def pool_bytes(self) -> int:
        """Bytes of the target's KV pool (the drafter's is one layer more, small)."""
        c = self.model.config
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        return 2 * c.num_layers * self.config.slots * c.num_kv_heads * self.limit * c.head_dim * itemsize

    def prefix_bytes(self) -> int:
        """Bytes of the prefix cache: its keys and values and the drafter's taps (SmolLM2: 15% more)."""
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        tokens = self.prefix_tokens // BLOCK * BLOCK  # whole blocks
        return self.pool_bytes() * tokens // (self.config.slots * self.limit) + tokens * self._taps_width() * itemsize

    @property
    def tpool(self) -> KVCache:
        self.allocate()
        assert self._pools is not None
        return self._pools[0]

    @property
    def dpool(self) -> KVCache | None:
        self.allocate()
        assert self._pools is not None
        return self._pools[1]

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache (None: off)."""
        self.allocate()
        return self._prefix

    # ------------------------------------------------------------ requests in and out

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.config.slots - len(self.rows)

    def check(self, prompt_len: int, options: GenerateOptions) -> None:
        """Raise ContextLengthError when a request cannot fit a slot (before it is queued)."""
        check_context(prompt_len, options.max_new_tokens, self.limit, self.margin,
                      where=f"the {self.limit} tokens of a batch slot")

    def add(self, key: Hashable, prompt_ids: Sequence[int], options: GenerateOptions,
            generator: torch.Generator | None = None) -> int:
        """Take a request into a free slot (``BatchFullError`` when none is free). Returns how many of
        its prompt tokens came from the prefix cache (their prefill is skipped). ``generator``: the
        request's random draws (default: one seeded from its sampling options; greedy needs none)."""
        if not self.free_slots:
            raise BatchFullError(f"all {self.config.slots} batch slots are taken")
        self.check(len(prompt_ids), options)
        if generator is None and not options.sampling.greedy:
            generator = options.sampling.make_generator(self.model.device)
        row = _Row(key=key, prompt=list(prompt_ids), options=options, text=TextAssembler(self.tokenizer, options),
                   arrived=time.perf_counter(), sampling=options.sampling, generator=generator)
        if self.drafting and any(s.ngram for s in self.shapes):  # n-gram proposals read the request's tokens
            row.ngram = NgramIndex()
            row.ngram.extend(row.prompt)
        j = len(self.rows)
        for pool in (self.tpool, self.dpool):  # the row's slots are free: whatever they held is not counted
            if pool is not None:
                pool.rows(j, j + 1).truncate(0)
        if (prefix := self.prefix) is not None and (blocks := prefix.match(row.prompt)):
            taps = prefix.load(blocks, self.tpool, j)
            row.cached = len(blocks) * prefix.block
            self.tpool.rows(j, j + 1).advance(row.cached)
            if self._aux():  # the prompt's taps wait for the drafter, as after computing them
                assert taps is not None, "a drafting engine stores taps with every block"
                row.pending_hidden.append(taps)
                row.pending_tokens += row.prompt[1:row.cached + 1]
        self.rows.append(row)
        return row.cached

    def remove(self, key: Hashable) -> Finished | None:
        """Drop a request now (its client went away); its slot is free for the next step."""
        for i, row in enumerate(self.rows):
            if row.key == key:
                self._drop(i)
                return Finished(key, "cancelled", len(row.text.token_ids), row.profile)
        return None

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, decode: bool = True) -> StepReport:
        """A prefill chunk of the waiting request that has had the fewest, then one decode step of every
        decoding row (``decode=False``: the prefill chunk only; a request alone so gets its first token
        before its first decode step)."""
        return self._step(decode)

    def _step(self, decode: bool) -> StepReport:
        report = StepReport()
        if self.decoding < len(self.rows):
            t0 = time.perf_counter()
            self._prefill_chunk(report)
            report.prefill_seconds = time.perf_counter() - t0
            self._release_finished(report)  # a request may end with its first token
        if self.decoding and decode:
            batch = self.decoding
            spec = self.policy.choose(batch)
            t0 = time.perf_counter()
            if spec:
                self._spec_step(report)
            else:
                self._plain_step(report)
            report.seconds = time.perf_counter() - t0
            report.batch, report.speculative = batch, spec
            self.policy.record(batch, spec, report.tokens, report.seconds)
        self._release_finished(report)
        return report

    def _emit(self, report: StepReport, row: _Row, tokens: list[int]) -> None:
        if row.ngram is not None:
            row.ngram.extend(tokens)
        chunk = row.text.add(tokens)
        report.events.append((row.key, chunk))

    def _release_finished(self, report: StepReport) -> None:
        for i in range(len(self.rows) - 1, -1, -1):
            row = self.rows[i]
            if row.text.finish_reason:
                report.finished.append(Finished(row.key, row.text.finish_reason, len(row.text.token_ids),
                                                row.profile))
                self._drop(i)

    # ------------------------------------------------------------ prefill

    def _prefill_chunk(self, report: StepReport) -> None:
        # The waiting request with the fewest chunks prefilled so far (then the earliest): chunks go round
        # the waiting requests, so a short prompt behind a long one starts after one of its chunks, not
        # after all of them (a 7001-token prompt held a short request's first token 17.6 s: issue 26)
        chunk, lengths = self.config.prefill_chunk, self.tpool.lengths
        j = min(range(self.decoding, len(self.rows)),
                key=lambda i: (-(-(lengths[i] - self.rows[i].cached) // chunk), self.rows[i].arrived))
        row = self.rows[j]
        a = lengths[j]
        b = min(a + self.config.prefill_chunk, len(row.prompt))
        logits = prefill(self.model, self.tpool.rows(j, j + 1), row, row.prompt, b, self._aux(), self.runner)
        report.prefill_tokens += b - a
        if b < len(row.prompt):
            return
        if self.prefix is not None:  # before the drafter takes the taps
            self.prefix.save(row.prompt, self.tpool, j, torch.cat(row.pending_hidden) if self._aux() else None)
        root = int(sample(logits, row.options.sampling, row.generator))
        if self._aux():
            assert self.drafter is not None and self.dpool is not None
            start_draft(self.drafter, self.dpool.rows(j, j + 1), row, root, self.runner)  # the whole prompt
        row.root = root
        if j != self.decoding:
            self._swap(j, self.decoding)
        self.decoding += 1
        self._emit(report, row, [row.root])

    def _aux(self) -> tuple[int, ...]:
        return tuple(self.drafter.config.aux_layer_ids) if self.drafting and self.drafter is not None else ()

    # ------------------------------------------------------------ decode steps

    def _plain_step(self, report: StepReport) -> None:
        n, device = self.decoding, self.model.device
        rows, pool = self.rows[:n], self.tpool.rows(0, n)
        host = pool.lengths
        lengths = torch.tensor(host, device=device)
        mask = rows_mask(host, torch.ones(n, 1, 1, dtype=torch.bool, device=device), max(host) + 1)
        aux = self._aux()
        out = self.runner.target(self.model, torch.tensor([[r.root] for r in rows], device=device), lengths[:, None],
                                 pool, attention_mask=mask, hidden_layers=aux, slots=lengths[:, None])
        pool.advance(1)
        hidden = torch.cat(out.hidden_states, -1) if aux else None
        catch_up = False
        # one argmax over the batch (per-row calls took 7% of a 32-row step)
        greedy = greedy_argmax(out.logits[:, -1]).tolist() if any(r.options.sampling.greedy for r in rows) else []
        for b, row in enumerate(rows):
            row.root = (greedy[b] if row.options.sampling.greedy
                        else int(sample(out.logits[b, -1], row.options.sampling, row.generator)))
            if hidden is not None:
                row.pending_hidden.append(hidden[b])
                row.pending_tokens.append(row.root)
                catch_up |= len(row.pending_tokens) > MAX_PENDING_PAIRS
            self._emit(report, row, [row.root])
        report.tokens = n
        if catch_up:
            self._extend_all()

    def _spec_step(self, report: StepReport) -> None:
        assert self.drafter is not None and self.spec is not None and self.dpool is not None
        n = self.decoding
        rows = self.rows[:n]
        cycle = spec_cycle(self.model, self.drafter, self.tpool.rows(0, n), self.dpool.rows(0, n), rows, self.spec,
                           PhaseClock(self.model.device, self.sync, self.comm), self.runner, self.budget)
        for row, new_tokens, record in zip(rows, cycle.tokens, cycle.records, strict=True):
            row.profile.add(record)
            report.cycles.append(record)
            report.tokens += len(new_tokens)
            self._emit(report, row, new_tokens)
            if self.adapt is not None:
                self.spec = self.adapt.record(self.spec, record.accepted)
        report.phases = {k: v for k, v in cycle.times.items() if k != "total"}

    def _extend_all(self) -> None:
        """Every decoding row's pending pairs through the drafter, in one batched forward."""
        assert self.drafter is not None and self.dpool is not None
        extend_rows(self.drafter, self.dpool.rows(0, self.decoding), self.rows[:self.decoding], self.runner)

    # ------------------------------------------------------------ pool rows

    def _copy_row(self, src: int, dst: int) -> None:
        self.tpool.copy_row(src, dst)
        if self.dpool is not None:
            self.dpool.copy_row(src, dst)

    def _swap(self, i: int, j: int) -> None:
        """Swap two rows (cache contents, lengths and bookkeeping)."""
        self.tpool.swap_rows(i, j)
        if self.dpool is not None:
            self.dpool.swap_rows(i, j)
        self.rows[i], self.rows[j] = self.rows[j], self.rows[i]

    def _drop(self, i: int) -> None:
        """Free row i: the last row of its block moves into its place."""
        if i < self.decoding:
            last = self.decoding - 1
            if i != last:
                self._copy_row(last, i)
                self.rows[i] = self.rows[last]
            if len(self.rows) - 1 != last:  # a prefilling row fills the decoding block's hole
                self._copy_row(len(self.rows) - 1, last)
                self.rows[last] = self.rows[-1]
            self.decoding -= 1
        elif i != len(self.rows) - 1:
            self._copy_row(len(self.rows) - 1, i)
            self.rows[i] = self.rows[-1]
        self.rows.pop()


def generate_all(model: Transformer, prompts: Sequence[Sequence[int]],
                 options: GenerateOptions | Sequence[GenerateOptions], stop_token_ids: Sequence[int],
                 config: BatchConfig = BatchConfig(slots=32, spec_policy="never"),
                 drafter: Drafter | None = None, spec: SpecConfig | None = None,
                 on_done: Callable[[int, list[int]], None] | None = None,
                 runner: StepRunner = EAGER) -> list[list[int]]:
    """Offline generation for many prompts through continuous batching (``data build``): each
    prompt's new token ids, ending at its first stop token (included) or after its
    ``max_new_tokens``; requests join as others finish, so no row waits for the longest.
    ``on_done(index, ids)`` as each finishes."""
    per = [options] * len(prompts) if isinstance(options, GenerateOptions) else list(options)
    if len(per) != len(prompts):
        raise ValueError(f"{len(per)} options for {len(prompts)} prompts")
    engine = BatchEngine(model, TokenIdsOnly(tuple(stop_token_ids)), drafter, spec, config, runner=runner)
    out: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))
    while queue or engine.active:
        while queue and engine.free_slots:
            i = queue.pop(0)
            engine.add(i, prompts[i], per[i])
        report = engine.step()
        for key, chunk in report.events:
            out[cast(int, key)] += chunk.token_ids  # keys are prompt indices
        if on_done:
            for done in report.finished:
                on_done(cast(int, done.key), out[cast(int, done.key)])
    return out
