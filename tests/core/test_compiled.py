"""Compiled steps (``core.compiled``): the same tokens as eager (float64 greedy, alone and in a batch,
plain and speculative), one graph per bucket and no recompilation as positions advance.

Each graph costs 10-20 s of inductor compilation on a small CPU, so the tests share a few: one
model, shapes chosen to land in the same buckets."""

from __future__ import annotations

import random

import pytest
import torch

import specdecode.core.compiled as compiled_module
from specdecode.core.batching import BatchConfig, BatchEngine
from specdecode.core.compiled import MIN_SPAN, CompiledRunner, bucket, check_compile_mode, span_bucket
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import Engine
from specdecode.core.requests import GenerateOptions
from specdecode.core.specpolicy import CALIBRATION_STEPS
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from tests.core.helpers import RecordingStore, Tok, generate, run_all
from tests.helpers import tiny_model

SPEC = SpecConfig(2, 2, 5)  # verifies 5 tokens: the 8-token bucket


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def drafter(model):
    return random_drafter(model, seed=2)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    # > 16 tokens: eager prefill; the third request's caches are twice the others' (a graph of its own)
    lengths = [24, 37, 250, 31]  # the third: 250 + 24 new tokens
    return [[rng.randrange(4, 97) for _ in range(n)] for n in lengths]


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_buckets():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 9]
    assert span_bucket(10, 4096) == MIN_SPAN and span_bucket(MIN_SPAN + 1, 4096) == 2 * MIN_SPAN
    assert span_bucket(3000, 1000) == 1000  # never past the cache
    assert CompiledRunner().capacity(70) == MIN_SPAN and CompiledRunner().capacity(300) == 2 * MIN_SPAN
    with pytest.raises(ValueError, match="use one of auto, on, off"):
        check_compile_mode("maybe")


@pytest.fixture(scope="module")
def steps():
    return CompiledRunner()  # shared: each graph compiles once for the whole module


def test_alone_equal_to_eager_and_no_recompilation(model, drafter, prompts, steps):
    """Baseline and EAGLE-3 (tree of 5 tokens; target and drafter compiled) give the eager tokens,
    float64. ``warm`` compiles what a request needs beforehand; requests of other lengths (other
    positions, same cache size) compile nothing; a request with twice the cache compiles its own
    graphs (its cache's size, for each span its context reaches: a request alone is a one-row pool whose
    span follows its context, as a batch's does), and every graph dynamo builds is a new bucket's, never a
    bucket's again."""
    short = [prompts[i] for i in (0, 1, 3)]
    eager_plain = [generate(model, None, p) for p in short]
    eager_spec = [generate(model, Eagle3Decoder(drafter, SPEC), p) for p in short]
    eager_long = generate(model, None, prompts[2])

    assert steps.warm(model, drafter, len(short[0]), 24, SPEC) > 0
    assert steps.warm(model, None, len(short[0]), 24, None) == 1  # plain decoding: one graph
    graphs, known = unique_graphs(), len(steps.compiled)
    plain = [generate(model, None, p, runner=steps) for p in short]
    spec = [generate(model, Eagle3Decoder(drafter, SPEC), p, runner=steps) for p in short]
    assert (unique_graphs(), len(steps.compiled)) == (graphs, known), "compiled while decoding"
    long = generate(model, None, prompts[2], runner=steps)
    assert unique_graphs() - graphs == len(steps.compiled) - known == 2  # spans 256 and 512
    assert len({k for k, _ in steps.compiled}) == len(steps.compiled)
    assert plain == eager_plain
    assert spec == eager_spec
    assert eager_spec == eager_plain  # lossless, as everywhere
    assert long == eager_long
    target = {(k.rows, k.tokens, k.span) for k, _ in steps.compiled if k.kind.startswith("target")}
    assert target == {(1, 1, 256), (1, 8, 256), (1, 1, 512)}  # decode, verify (5 -> 8); the long request's decode
    draft = {k.kind for k, _ in steps.compiled if k.kind.startswith("draft")}
    assert draft == {f"draft[{3 * model.config.hidden_size}]", f"draft[{model.config.hidden_size}]"}  # extend, tree


def test_batch_equal_to_eager(model, drafter, prompts, steps):
    """Three requests in a pool of four (rows padded 3 -> 4, tokens 5 -> 8), speculative steps:
    every request's greedy tokens as eager."""
    options = GenerateOptions(max_new_tokens=20, stop_token_ids=())
    short = [prompts[i] for i in (0, 1, 3)]
    expected = [generate(model, None, p, 20) for p in short]
    engine = BatchEngine(model, Tok(), drafter, SPEC, BatchConfig(slots=4, prefill_chunk=64, spec_policy="always"),
                         runner=steps)
    out, _ = run_all(engine, short, options)
    assert [out[i] for i in range(3)] == expected
    assert any(k.rows == 4 and k.tokens == 8 for k, _ in steps.compiled), steps.compiled


def test_two_drafters_never_share_a_graph(model, drafter, prompts, steps):
    """A graph holds its module's weights as constants: another drafter of the same shapes (a bench
    comparing drafters) gets graphs of its own, and its own tokens."""
    other = random_drafter(model, seed=9)
    eager = generate(model, Eagle3Decoder(other, SPEC), prompts[0])
    steps.warm(model, drafter, len(prompts[0]), 24, SPEC)  # (compiled already when the module runs in order)
    assert steps.warm(model, other, len(prompts[0]), 24, SPEC) > 0  # the target's graphs exist: the draft's
    assert generate(model, Eagle3Decoder(other, SPEC), prompts[0], runner=steps) == eager
    owners = {k.owner for k, _ in steps.compiled if k.kind.startswith("draft")}
    assert {id(drafter), id(other)} <= owners


def test_training_mode_stays_eager():
    """Gradients never go through compiled (frozen) steps; prefill chunks stay eager."""
    steps = CompiledRunner()
    assert torch.is_grad_enabled() and not steps.serves(1, 1)
    with torch.inference_mode():
        assert steps.serves(1, 16) and not steps.serves(1, 17)


@pytest.mark.parametrize("policy, invariant", [("never", False), ("always", False), ("auto", False),
                                               ("always", True)])
def test_a_warmed_pool_runs_every_decode_step_on_a_warmed_graph(model, drafter, prompts, policy, invariant):
    """``BatchEngine.warm`` builds every graph the pool's decode steps then use (every batch size,
    span, plain and speculative step, catch-up extends under 'auto'), and after ``seal`` nothing is
    built: a server's requests never wait for the compiler. Tokens as eager, float64."""
    options = GenerateOptions(max_new_tokens=24, stop_token_ids=())
    alone = [Engine(model, Tok(), Eagle3Decoder(drafter, SPEC)).generate(p, options).token_ids for p in prompts]
    store = RecordingStore()
    steps = CompiledRunner(store=store)
    engine = BatchEngine(model, Tok(), drafter, SPEC, BatchConfig(slots=3, slot_tokens=512, spec_policy=policy,
                                                                  batch_invariant=invariant), runner=steps)
    built = engine.warm(512, seal=True)
    warmed = set(store.built)
    assert built == len(warmed) == len(steps.compiled) and not engine.runner.build
    assert {k.rows for k in warmed} == ({3} if invariant else {1, 2, 3})
    assert {k.span for k in warmed} == {0} and store.spans == {256, 512}  # a stored graph serves every span
    store.calls.clear()
    engine.calibrate(prompts[0])
    if policy == "auto":  # both modes timed on the graphs they will run on, not eager
        timed = {k.kind[:5] for k in store.calls}
        assert timed == {"targe", "draft"} and sum(store.calls.values()) > 4 * CALIBRATION_STEPS
    got, _ = run_all(engine, prompts, options)
    assert [got[i] for i in range(len(prompts))] == alone
    assert set(steps.graphs) == warmed and not steps.eager and len(store.built) == built  # no shape outside the warmed
    kinds = {k.kind for k in warmed}
    assert any(k.startswith("draft") for k in kinds) == (policy != "never")
    assert ("target[]" in kinds) == (policy == "never")
    assert engine.warm(512) == 0  # warmed again: every graph is there


def test_warm_is_a_no_op_on_eager_steps_and_with_requests(model, drafter, prompts):
    engine = BatchEngine(model, Tok(), drafter, SPEC, BatchConfig(slots=2, slot_tokens=512))
    assert engine.warm() == 0  # no compiled steps


def test_inductor_packs_follows_onednn_support():
    assert compiled_module.inductor_packs(torch.float32, "cpu") and compiled_module.inductor_packs(torch.float64, "cpu")
    assert compiled_module.inductor_packs(torch.bfloat16, "cuda")
    assert compiled_module.inductor_packs(torch.bfloat16, "cpu") == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_a_drafter_whose_layers_inductor_cannot_pack_drafts_eager(model, drafter, prompts, monkeypatch):
    """Where inductor would run a drafter's linear layers as aten matmuls (bf16 on a CPU without bf16),
    its steps stay eager: no draft graph is warmed or built, the target's still are; tokens as eager."""
    monkeypatch.setattr(compiled_module, "inductor_packs", lambda dtype, device_type: False)
    options = GenerateOptions(max_new_tokens=24, stop_token_ids=())
    alone = [Engine(model, Tok(), Eagle3Decoder(drafter, SPEC)).generate(p, options).token_ids for p in prompts[:2]]
    store = RecordingStore()
    steps = CompiledRunner(store=store)
    engine = BatchEngine(model, Tok(), drafter, SPEC, BatchConfig(slots=2, slot_tokens=512, spec_policy="always"),
                         runner=steps)
    assert engine.warm(512, seal=True) > 0
    got, _ = run_all(engine, prompts[:2], options)
    single = Engine(model, Tok(), Eagle3Decoder(drafter, SPEC, runner=steps)).generate(prompts[0], options).token_ids
    assert [got[i] for i in range(2)] == alone and single == alone[0]
    assert store.built and all(k.kind.startswith("target") for k in steps.graphs)


def test_cuda_graph_calls_mark_the_cache_static_and_copy_outputs():
    """Under CUDA graphs a step's cache tensors must have static addresses (else inductor skips CUDA
    graphs: "mutated inputs", seen on an H200) and a replay's outputs are its own buffers, reused by
    the next replay: the caller gets copies. Elsewhere (CPU, stored graphs) the call is untouched."""
    from specdecode.core.kvcache import KVCache

    pool = KVCache.allocate(2, 4, 1, 8, 2, dtype=torch.float32, device="cpu")
    view = pool.rows(1, 3)
    logits, hidden = torch.randn(2, 1, 5), torch.randn(2, 1, 3)

    def fn(*args):
        return logits, [hidden]

    out = CompiledRunner(device_type="cuda")._call(fn, (), view)
    assert torch.equal(out[0], logits) and torch.equal(out[1][0], hidden)
    assert out[0].data_ptr() != logits.data_ptr() and out[1][0].data_ptr() != hidden.data_ptr()
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in (*view.k, *view.v))

    other = pool.rows(0, 2)
    for steps in (CompiledRunner(), CompiledRunner(device_type="cuda", compile=False)):
        out = steps._call(fn, (), other)
        assert out[0] is logits and out[1][0] is hidden
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in (*other.k, *other.v))
