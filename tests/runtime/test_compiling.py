"""When steps run compiled (``runtime.compiling``), the flag as every command parses it, the bench
method's ``compile=``, the GPU check's refusal where there is no GPU, and graphs stored on disk
(``PackageStore``): equal to eager, loaded by a new store without compiling, keyed by the weights,
a damaged one said and left to eager, ``generate --compile auto`` using them."""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdecode.bench.methods import build_method
from specdecode.cli.common import runtime_config
from specdecode.cli.main import build_parser, main
from specdecode.core.batching import BatchConfig, BatchEngine, generate_all
from specdecode.core.compiled import CompiledRunner, DraftStep, TargetStep, span_buckets
from specdecode.core.drafter import random_drafter
from specdecode.core.engine import baseline_decode
from specdecode.core.quant import quantize_weights
from specdecode.core.requests import GenerateOptions
from specdecode.core.runner import EAGER
from specdecode.core.speculative import Eagle3Decoder, SpecConfig
from specdecode.io.loading import LoadedModel
from specdecode.runtime import background, graphstore
from specdecode.runtime.compiling import precompile, precompile_pool, resolve_compile, stored_steps
from specdecode.runtime.graphstore import TRACED_MODULES, PackageStore, code_identity
from specdecode.runtime.session import RuntimeConfig, Session
from tests.core.helpers import Tok, generate
from tests.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_session():
    model = tiny_model(seed=2, dtype=torch.float32)
    loaded = LoadedModel(model, Tok(), Path("tiny"), Path("tiny"))  # type: ignore[arg-type]
    return Session(RuntimeConfig(dtype="float32", weights="native"), loaded, torch.device("cpu"), torch.float32, 1)


def test_auto_compiles_long_running_jobs_only():
    assert resolve_compile("auto", True, 1)[0] is True
    on, why = resolve_compile("auto", False, 1)
    assert on is False and "only graphs already stored" in why
    assert resolve_compile("on", False, 1) == (True, "on: as asked")
    assert resolve_compile("off", True, 1) == (False, "off: as asked")
    assert resolve_compile("auto", True, 2) == (False, "eager: tensor parallelism (2 ranks)")
    with pytest.raises(ValueError, match="tensor parallelism is not supported"):
        resolve_compile("on", True, 2)
    with pytest.raises(ValueError, match="use one of auto, on, off"):
        resolve_compile("yes", True, 1)


@pytest.mark.parametrize("argv, long_running, stored", [
    (["serve"], False, True), (["data", "build", "--out", "o", "--prompts", __file__], True, False),
    (["generate", "hi"], False, True), (["bench"], False, False), (["sweep"], False, False)])
def test_every_command_parses_the_flag(argv, long_running, stored):
    """auto: data build compiles at first use; generate and serve run the stored graphs (serve loads
    them all before the first request, ``compile --serve`` builds them); bench and sweep say per method."""
    config = runtime_config(build_parser().parse_args(argv))
    assert (config.compile, config.long_running, config.stored_graphs) == ("auto", long_running, stored)
    assert runtime_config(build_parser().parse_args([*argv, "--compile", "on"])).compile == "on"


def test_bench_method_compile_parameter_is_checked(tiny_session):
    with pytest.raises(ValueError, match="compile must be on or off"):
        build_method("baseline:compile=maybe", tiny_session)
    with pytest.raises(ValueError, match="takes no parameters but compile"):
        build_method("baseline:steps=2", tiny_session)
    eager = build_method("baseline:compile=off", tiny_session)
    compiled = build_method("baseline:compile=on", tiny_session)
    assert eager.runner is EAGER and compiled.runner is tiny_session.compiled is not None
    assert compiled.decoder.runner is compiled.runner and eager.decoder.runner is EAGER


def test_precompile_pool_builds_what_serve_runs(tiny_session, tmp_path):
    """``compile --serve``: the pool's graphs built into the store (here one: plain steps, one row, any
    span) and found there the second time; without a store it is refused."""
    batch = BatchConfig(slots=1, slot_tokens=256)
    with pytest.raises(ValueError, match="build into a store"):
        precompile_pool(tiny_session.compiled, tiny_session.loaded, baseline_decode, batch, 256)
    session = replace(tiny_session, compiled=CompiledRunner(store=PackageStore(tmp_path)))
    heard: list[tuple[int, int]] = []
    first = precompile_pool(session.compiled, session.loaded, baseline_decode, batch, 256,
                            lambda i, n: heard.append((i, n)))
    assert [(k.kind, k.rows, k.tokens, k.span) for k, _ in first.built] == [("target[]", 1, 1, 0)]
    assert first.loaded == 0 and first.sizes == [256] and heard == [(0, 1), (1, 1)] and first.disk_bytes > 0
    again = precompile_pool(CompiledRunner(store=PackageStore(tmp_path)), session.loaded, baseline_decode, batch, 256)
    assert again.built == [] and again.loaded == 1
    # a server of 4 slots over that store (one row's graph stored, 2 and 4 rows not): a request alone would run the
    # graph and the same request batched eager steps, which round otherwise (issue 66), so every step runs eager
    model = session.loaded.model
    alone = BatchEngine(model, Tok(), config=BatchConfig(slots=1, slot_tokens=256),
                        runner=CompiledRunner(store=PackageStore(tmp_path), build=False))
    alone.warm(256, seal=True)
    assert not alone.mixed_steps and isinstance(alone.runner, CompiledRunner)  # its every step is stored
    pool = BatchEngine(model, Tok(), config=BatchConfig(slots=4, slot_tokens=256),
                       runner=CompiledRunner(store=PackageStore(tmp_path), build=False))
    pool.warm(256, seal=True)
    assert pool.mixed_steps and pool.runner is EAGER
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32]]
    options = GenerateOptions(max_new_tokens=6, stop_token_ids=())
    together = generate_all(model, prompts, options, (), BatchConfig(slots=4, slot_tokens=256), runner=pool.runner)
    assert together == [generate_all(model, [p], options, (), BatchConfig(slots=1, slot_tokens=256))[0]
                        for p in prompts]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
def test_gpu_check_refuses_without_cuda():
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHON": sys.executable})
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr


# --- graphs stored on disk (PackageStore: torch.export + AOTInductor) -----------------------------
# Each stored graph is an ahead-of-time build (about 15-30 s each for the tiny model on 2 cores), so
# one module-scoped store serves every test below: an EAGLE-3 chain of 1 (verify 2 tokens, draft steps).

CHAIN = SpecConfig(1, 1, 2)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    model = tiny_model(seed=5, max_position_embeddings=1024)  # float64: compiled must equal eager exactly
    drafter = random_drafter(model, seed=2)
    rng = random.Random(1)
    prompt = [rng.randrange(4, 97) for _ in range(24)]  # > 16 tokens: the prefill stays eager
    root = tmp_path_factory.mktemp("graphs")
    eager = generate(model, Eagle3Decoder(drafter, CHAIN), prompt)
    steps = CompiledRunner(store=PackageStore(root))
    built = generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=steps)
    return model, drafter, prompt, root, eager, built, steps


def test_stored_graphs_equal_eager_and_a_new_process_loads_them(stored):
    model, drafter, prompt, root, eager, built, steps = stored
    assert built == eager
    kinds = {k.kind for k, _ in steps.compiled}
    assert any(k.startswith("target") for k in kinds) and any(k.startswith("draft") for k in kinds)
    assert len(list(root.glob("*/*.pt2"))) == len(steps.compiled) and not list(root.glob("*/.building/*"))
    records = [json.loads(p.read_text()) for p in root.glob("*/identity.json")]  # what compile --prune reads
    assert len(records) == len({p.parent for p in root.glob("*/*.pt2")}) and all(
        r["code"] == code_identity() for r in records)
    # a new store (as a new process has) that may not build: every graph loaded, none compiled
    import tempfile

    def extracted() -> set[Path]:
        tmp = Path(tempfile.gettempdir())
        return {*tmp.glob("aotinductor_*"), *tmp.glob("specdecode-aoti-*")}

    before = extracted()
    again = CompiledRunner(store=PackageStore(root), build=False)
    assert generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=again) == eager
    # the loader's extraction is removed once loaded (it leaked 150 MB per graph and process: a full disk)
    assert extracted() <= before
    assert again.compiled == [] and sorted(map(str, again.loaded)) == sorted(str(k) for k, _ in steps.compiled)


def test_other_weights_other_graphs(stored):
    model, drafter, _, root, *_ = stored
    store = PackageStore(root)
    assert store.count(model) + store.count(drafter) == len(list(root.rglob("*.pt2")))
    other = tiny_model(seed=6, max_position_embeddings=1024)
    assert store.count(other) == 0 and store.identity(other) != store.identity(model)
    with torch.no_grad():  # one weight of the embedding changed: neither the target's graphs nor the drafter's
        model.embed_tokens.weight[0, 0] += 1  # (the drafter holds the target's embedding outside its state_dict)
    try:
        assert PackageStore(root).count(model) == 0 and PackageStore(root).count(drafter) == 0
    finally:
        with torch.no_grad():
            model.embed_tokens.weight[0, 0] -= 1
    assert PackageStore(root).count(model) > 0 and PackageStore(root).count(drafter) > 0


def test_damaged_graph_is_said_and_left_to_eager(stored, tmp_path):
    model, drafter, prompt, root, eager, *_ = stored
    copy = tmp_path / "graphs"
    shutil.copytree(root, copy)
    for f in copy.rglob("*.pt2"):
        f.write_bytes(f.read_bytes()[:1000])  # cut short, as a full disk or a killed copy leaves it
    said: list[str] = []
    steps = CompiledRunner(store=PackageStore(copy, log=said.append), build=False)
    assert generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=steps) == eager
    assert steps.loaded == [] and said and "is damaged" in said[0] and "removed" in said[0]
    assert not list(copy.rglob("*.pt2"))  # removed, so the next build writes it whole


def test_corrupt_content_in_a_whole_zip_is_caught_before_the_loader_runs_it(stored, tmp_path):
    """Bytes changed inside a package whose zip structure is intact: loading it let the C++ loader run a corrupt
    library, and the process died by SIGTRAP with no message. Each member's CRC is checked first: one line, the
    package removed, the shape eager."""
    model, drafter, prompt, root, eager, *_ = stored
    copy = tmp_path / "graphs"
    shutil.copytree(root, copy)
    packages = sorted(copy.rglob("*.pt2"))
    for f in packages:
        with zipfile.ZipFile(f) as z:
            lib = max(z.infolist(), key=lambda i: i.file_size)  # the library
        data = bytearray(f.read_bytes())
        start = lib.header_offset + 30 + len(lib.filename.encode()) + len(lib.extra)
        for at in range(start + lib.compress_size // 3, start + lib.compress_size // 3 + 4096):
            data[at] ^= 0xFF
        f.write_bytes(bytes(data))
        with zipfile.ZipFile(f) as z:
            assert z.namelist() and z.testzip() == lib.filename  # still a zip; its content fails the CRC
    said: list[str] = []
    steps = CompiledRunner(store=PackageStore(copy, log=said.append), build=False)
    assert generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=steps) == eager
    assert steps.loaded == [] and len(said) == len(packages) and all("fails its CRC check" in m for m in said)
    assert not list(copy.rglob("*.pt2"))


def test_partial_builds_of_dead_processes_are_pruned_and_the_cap_takes_inf(tmp_path, monkeypatch):
    """A build killed midway leaves <graph>.<pid>.pt2 in .building/: the next build or prune removes those of
    processes no longer alive and keeps a live builder's. $SPECDECODE_GRAPH_CACHE_GB=inf means no cap."""
    where = tmp_path / "graphs" / "abc"
    building = where / graphstore.BUILDING
    building.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (building / f"target-r1-t1.{int(dead.stdout)}.pt2").write_bytes(b"partial")
    (building / f"target-r1-t2.{os.getpid()}.pt2").write_bytes(b"being built")
    PackageStore(tmp_path / "graphs").prune()
    assert [p.name for p in building.iterdir()] == [f"target-r1-t2.{os.getpid()}.pt2"]
    monkeypatch.setenv(graphstore.CAP_ENV, "inf")
    assert graphstore.graph_cache_cap() == sys.maxsize
    for bad in ("nan", "-1", "lots"):
        monkeypatch.setenv(graphstore.CAP_ENV, bad)
        with pytest.raises(ValueError, match="inf: no cap"):
            graphstore.graph_cache_cap()


def test_generate_auto_runs_stored_graphs_only_when_there_are_some(stored, tmp_path, monkeypatch):
    model, *_ = stored
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    steps, why = stored_steps(model, torch.device("cpu"), None, None)
    assert steps is None and "stays eager" in why and "specdecode compile" in why
    shutil.copytree(stored[3], tmp_path / "graphs")
    steps, why = stored_steps(model, torch.device("cpu"), None, None)
    assert steps is not None and not steps.build and "graphs stored" in why
    parse = build_parser().parse_args
    assert runtime_config(parse(["generate", "hi"])).stored_graphs
    assert not runtime_config(parse(["bench"])).stored_graphs  # bench measures what it is told


def test_graphs_of_integer_layers_bind_the_live_weights(stored, tmp_path):
    """A graph of a target with integer layers (int8 here, 4-bit alike) carries no weights: the loader
    binds the live module's tensors, in place, and the output equals eager. A float target's graph, or a
    drafter's, freezes its own copy (inductor packs its matmuls for oneDNN), but never the target's
    embedding a drafter holds: that is an input of each call."""
    model, drafter, *_ = stored
    assert not graphstore.binds_weights(model) and not graphstore.binds_weights(drafter)
    int8 = tiny_model(seed=5, dtype=torch.float32, max_position_embeddings=1024)
    quantize_weights(int8, "int8")
    assert graphstore.binds_weights(int8)
    rng = random.Random(3)
    prompt = [rng.randrange(4, 97) for _ in range(24)]
    eager = generate(int8, None, prompt)
    steps = CompiledRunner(store=PackageStore(tmp_path))
    longer = [rng.randrange(4, 97) for _ in range(300)]  # a cache of 512 slots, not 256: the same graphs
    assert generate(int8, None, prompt, runner=steps) == eager
    built = len(steps.compiled)
    assert generate(int8, None, longer, runner=steps) == generate(int8, None, longer) and len(steps.compiled) == built
    again = CompiledRunner(store=PackageStore(tmp_path), build=False)  # as a new process: loaded and bound
    assert generate(int8, None, prompt, runner=again) == eager
    assert again.loaded and again.compiled == []
    graph = next(iter(again.graphs.values()))
    live = {t.data_ptr() for t in graphstore.live_tensors(TargetStep(int8, ())).values()}
    assert graph.bound and {t.data_ptr() for t in graph.bound.values()} <= live  # read in place, never copied
    # no copy on disk: the embedding's bytes are in the frozen float target's packages, not in these
    def holds(path: Path, weight: torch.Tensor) -> bool:
        with zipfile.ZipFile(path) as z:
            return any(weight[:2].contiguous().numpy().tobytes() in z.read(n) for n in z.namelist())

    assert all(not holds(p, int8.embed_tokens.weight) for p in tmp_path.rglob("*.pt2"))
    frozen_dir = stored[3] / PackageStore(stored[3]).identity(model)
    assert all(holds(p, model.embed_tokens.weight) for p in frozen_dir.glob("*.pt2"))
    drafter_dir = stored[3] / PackageStore(stored[3]).identity(drafter)  # the drafter reads the target's embedding
    drafted = list(drafter_dir.glob("*.pt2"))
    assert drafted and not any(holds(p, model.embed_tokens.weight) for p in drafted)
    draft_graph = graphstore.LoadedGraph(drafted[0], graphstore.live_tensors(DraftStep(drafter)))
    assert [t.data_ptr() for t in draft_graph.held] == [model.embed_tokens.weight.data_ptr()] and not draft_graph.bound
    # the rope frequencies stay a plain float32 attribute (a buffer only while exported)
    assert "inv_freq" in vars(int8) and "inv_freq" not in dict(int8.named_buffers())
    # a module without the tensors a bound graph reads is refused, by name
    path = next(tmp_path.rglob("*.pt2"))
    with pytest.raises(ValueError, match="reads weights the module does not have"):
        graphstore.LoadedGraph(path, {})


def test_a_drafter_in_integer_kernels_binds_its_live_weights_too(tmp_path):
    """``--drafter-weights int8|q4``: the drafter's graphs are bound like an integer target's (no copy of its
    weights in a package, nor of the target's embedding), load in a new store, and decode as eager does."""
    from specdecode.core.quant import quantize_linears

    model = tiny_model(seed=5, dtype=torch.float32, max_position_embeddings=1024)
    quantize_weights(model, "int8")
    drafter = random_drafter(model, seed=2)
    quantize_linears(drafter, "int8")
    assert graphstore.binds_weights(drafter)
    rng = random.Random(4)
    prompt = [rng.randrange(4, 97) for _ in range(24)]
    eager = generate(model, Eagle3Decoder(drafter, CHAIN), prompt)
    assert generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=CompiledRunner(store=PackageStore(tmp_path))) \
        == eager
    again = CompiledRunner(store=PackageStore(tmp_path), build=False)
    assert generate(model, Eagle3Decoder(drafter, CHAIN), prompt, runner=again) == eager
    drafts = [k for k in again.loaded if k.kind.startswith("draft")]
    assert drafts and again.compiled == []
    graph = again.graphs[drafts[0]]
    live = {t.data_ptr() for t in graphstore.live_tensors(DraftStep(drafter)).values()}
    assert graph.bound and not graph.held and {t.data_ptr() for t in graph.bound.values()} <= live
    assert model.embed_tokens.weight.data_ptr() in {t.data_ptr() for t in graph.bound.values()}


def test_precompile_needs_a_store_and_covers_every_cache_size():
    assert span_buckets(1024, 8192) == [256, 512, 1024] and span_buckets(100, 8192) == [256]
    assert span_buckets(3000, 2048) == [256, 512, 1024, 2048]
    assert span_buckets(1024, 1000) == [256, 512, 1000]
    assert code_identity() == code_identity() and len(code_identity()) == 16


def test_a_graph_traced_with_the_native_attention_is_not_loaded_without_it(monkeypatch):
    """A graph calls the native attention operator or SDPA, whichever was registered when it was traced: a
    process without the operator (SPECDECODE_NATIVE=0, no compiler) must not load one that calls it."""
    model = tiny_model()
    monkeypatch.setattr(graphstore, "native_loaded", lambda op: True)
    with_it = graphstore.weights_identity(model)
    monkeypatch.setattr(graphstore, "native_loaded", lambda op: False)
    assert graphstore.weights_identity(model) != with_it


def test_the_code_identity_is_the_code_not_its_comments():
    """A comment or a docstring changed in a traced module rebuilt every stored graph; code changed must still."""
    code_only = graphstore._code_only
    plain = "def f(x):\n    return x + 1\n"
    commented = '"""Module."""\ndef f(x):\n    """Doc, 3.2 ms."""\n    return x + 1  # measured\n'
    assert code_only(commented) == code_only(plain)
    assert code_only("def f(x):\n    return x + 2\n") != code_only(plain)
    assert code_only('def f(x):\n    """Only a docstring."""\n') == code_only("def f(x):\n    pass\n")


def test_the_code_identity_covers_what_the_steps_import():
    """Every module of specdecode.core that the traced modules import (the step code's closure) is
    hashed into a graph's identity, so a change to it never loads a stale graph. compiled.py's own
    imports of the engine and the speculative cycle serve ``warm`` and the types, not a traced step."""
    core = ROOT / "specdecode" / "core"

    def imports(name: str) -> set[str]:
        tree = ast.parse((core / f"{name}.py").read_text())
        return {node.module.rsplit(".", 1)[1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("specdecode.core.")}

    todo, seen = [m for m in TRACED_MODULES if m != "compiled"], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imports(name))
    assert seen <= set(TRACED_MODULES), f"traced code imports {sorted(seen - set(TRACED_MODULES))}: add them"
    assert imports("compiled") - set(TRACED_MODULES) == {"requests", "runner", "speculative"}  # warm, types
    with pytest.raises(ValueError, match="build into a store"):
        precompile(tiny_model(), CompiledRunner(), None, [], 256)
    assert main(["compile", "--compile", "off"]) == 2


def test_prune_removes_the_graphs_of_other_code_only(tmp_path, capsys, monkeypatch):
    """`specdecode compile --prune`: directories whose record names other step code go; this code's stay,
    and directories without a record (stored before records, maybe another model's) are left and listed."""
    from specdecode.runtime.graphstore import PACKAGE_VERSION, RECORD

    def graph_dir(name: str, code: str | None) -> Path:
        where = tmp_path / "graphs" / name
        where.mkdir(parents=True)
        (where / "target-r1.pt2").write_bytes(b"x" * 1000)
        if code is not None:
            (where / RECORD).write_text(json.dumps({"code": code, "package_version": PACKAGE_VERSION}))
        return where

    current, old, unknown = graph_dir("a", code_identity()), graph_dir("b", "0" * 16), graph_dir("c", None)
    report = PackageStore(tmp_path / "graphs").prune(dry_run=True)
    assert [w for w, _ in report.removed] == [old] and old.exists()  # a dry run removes nothing
    assert [w for w, _ in report.kept] == [current] and [w for w, _ in report.unrecorded] == [unknown]
    assert report.removed[0][1] > 1000  # its bytes, record included
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert main(["compile", "--prune"]) == 0
    err = capsys.readouterr().err
    assert not old.exists() and current.exists() and unknown.exists()
    assert "removed 1 (0.00 GB) graph directories" in err and "1 (0.00 GB) without a record" in err


def test_the_graph_store_stays_under_its_cap_least_recently_used_first(tmp_path, capsys, monkeypatch):
    """A cap ($SPECDECODE_GRAPH_CACHE_GB) keeps the store bounded: whole weight directories go, least recently
    used first (a load or build marks its directory used), never the one in use; `compile --prune` applies it."""
    import os

    from specdecode.runtime.graphstore import PACKAGE_VERSION, RECORD

    def graph_dir(name: str, used: float) -> Path:
        where = tmp_path / "graphs" / name
        where.mkdir(parents=True)
        (where / "target-r1.pt2").write_bytes(b"x" * 4000)
        (where / RECORD).write_text(json.dumps({"code": code_identity(), "package_version": PACKAGE_VERSION}))
        os.utime(where / RECORD, (used, used))
        return where

    old, middle, new = graph_dir("a", 1000.0), graph_dir("b", 2000.0), graph_dir("c", 3000.0)
    store = PackageStore(tmp_path / "graphs", max_bytes=9000)
    assert [w for w, _ in store.trim(dry_run=True)] == [old] and old.exists()
    assert [w for w, _ in store.trim(keep=old)] == [middle]  # the directory in use stays, however old
    assert old.exists() and not middle.exists() and new.exists()
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECDECODE_GRAPH_CACHE_GB", "0.000005")  # 5000 bytes: room for one directory
    assert main(["compile", "--prune"]) == 0
    err = capsys.readouterr().err
    assert not old.exists() and new.exists()
    assert "least recently used, over the cap" in err
    monkeypatch.setenv("SPECDECODE_GRAPH_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="SPECDECODE_GRAPH_CACHE_GB"):
        PackageStore(tmp_path / "graphs")


def test_one_build_at_a_time_and_a_run_starts_the_missing_ones_in_the_background(tmp_path, monkeypatch):
    """A run hands the shapes it ran eager to `specdecode compile` with its own settings
    (``runtime.builds.build_missing``), started detached after the run; the store's lock lets one process build
    at a time (compile --if-idle leaves at once, before loading anything, when another holds it);
    $SPECDECODE_BACKGROUND_COMPILE=0 and a run that found every graph start nothing."""
    from types import SimpleNamespace

    from specdecode.core.costmodel import AutoSpec
    from specdecode.runtime.builds import DEFAULT_COMPILE_MAX_LEN, build_missing, compile_flags
    from specdecode.runtime.decoders import DecoderSpec

    runtime = RuntimeConfig(weights="int8", threads=3, stored_graphs=True)
    flags = compile_flags(runtime, DecoderSpec(config=AutoSpec(num_steps=2)), None, 512)
    assert flags == ["--weights", "int8", "--threads", "3", "--num-steps", "2", "--compile-max-len", "512"]
    assert compile_flags(runtime, DecoderSpec(speculative=False), None, 600)[2:5] == ["--threads", "3", "--no-spec"]

    root = tmp_path / "graphs"
    with background.build_lock(root) as mine:
        assert mine and background.building(root)
        with background.build_lock(root, wait=False) as second:
            assert not second
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
        assert main(["compile", "--if-idle", "--model", "/nonexistent.gguf"]) == 0  # left before loading the model
        monkeypatch.setenv(background.BACKGROUND_ENV, "1")
        assert "another process" in background.build_in_background(flags, root).why
    assert not background.building(root)

    started: list = []
    monkeypatch.setattr(background.subprocess, "Popen", lambda argv, **kw: started.append((argv, kw))
                        or SimpleNamespace(pid=4242))
    session = SimpleNamespace(compiled=CompiledRunner(store=PackageStore(root)), device=torch.device("cpu"),
                              world_size=1, config=runtime)
    auto = DecoderSpec(config=AutoSpec(num_steps=2))  # the top-k left to auto
    assert build_missing(session, auto, SpecConfig(2, 1, 3), 100) is None and not started  # every shape had a graph
    session.compiled.eager[object()] = object()  # a shape ran eager
    built = build_missing(session, auto, SpecConfig(2, 1, 3), 100)
    assert built.pid == 4242 and built.log == root / "build.log"
    argv, kw = started[0]
    assert argv[1:4] == ["-m", "specdecode.cli", "compile"] and argv[-1] == "--if-idle" and kw["start_new_session"]
    assert kw["preexec_fn"] is background.lowest_priority  # idle scheduling class
    # the run's settings and the shape it decoded with (not auto's pick again), at least compile's length; auto
    # chose the top-k here, so every candidate shape's graphs too (auto times them on graphs)
    assert argv[4:-1] == ["--weights", "int8", "--threads", "3", "--num-steps", "2", "--topk", "1",
                          "--num-draft-tokens", "3", "--with-candidates", "--compile-max-len",
                          str(DEFAULT_COMPILE_MAX_LEN)]
    build_missing(session, DecoderSpec(config=AutoSpec(2, 1)), SpecConfig(2, 1, 3), 100)  # a shape the user gave
    assert "--with-candidates" not in started[1][0]
    started.pop()
    monkeypatch.setenv(background.BACKGROUND_ENV, "0")
    assert build_missing(session, auto, SpecConfig(2, 1, 3), 100) is None and len(started) == 1
    monkeypatch.setenv(background.BACKGROUND_ENV, "1")
    for off in (replace(runtime, compile="off"), replace(runtime, stored_graphs=False)):  # bench: what it is told
        session.config = off
        assert build_missing(session, auto, None, 100) is None and len(started) == 1


@pytest.mark.parametrize("runtime, spec, shape, serve", [
    (RuntimeConfig(), None, None, None),
    (RuntimeConfig(model="m.gguf", dtype="bfloat16", weights="q4", threads=2, kernels="static", activations="int16"),
     {"drafter": "random", "aux_layer_convention": "vllm", "drafter_weights": "q4", "ngram": 3}, SpecConfig(3, 2, 5),
     None),
    (RuntimeConfig(weights="int8"), {"speculative": False}, None, None),
    (RuntimeConfig(), {"config": SpecConfig(2, 1, 3)}, None, None),
    (RuntimeConfig(dtype="float32"), {"adapt": True}, SpecConfig(2, 1, 3),
     BatchConfig(slots=8, slot_tokens=2048, prefill_chunk=64, spec_policy="always", batch_invariant=True)),
])
def test_compile_flags_parse_back_into_the_same_settings(runtime, spec, shape, serve):
    """``compile_flags`` is the inverse of the CLI's parsing: `specdecode compile` given them runs with the
    run's model, format, drafter, shape and batching."""
    from specdecode.cli.common import decoder_spec
    from specdecode.cli.serve import batch_config
    from specdecode.core.costmodel import AutoSpec
    from specdecode.runtime.builds import compile_flags
    from specdecode.runtime.decoders import DecoderSpec

    spec = DecoderSpec(**(spec or {}))
    args = build_parser().parse_args(["compile", *compile_flags(runtime, spec, shape, 777, serve=serve)])
    parsed = runtime_config(args)
    for name in ("model", "dtype", "weights", "device", "threads", "kernels", "activations"):
        assert getattr(parsed, name) == getattr(runtime, name), name
    got = decoder_spec(args)
    for name in ("speculative", "drafter", "aux_layer_convention", "drafter_weights", "ngram", "adapt"):
        assert getattr(got, name) == getattr(spec, name), name
    if spec.speculative:
        want = shape or spec.config
        config = got.config.static() if isinstance(got.config, AutoSpec) else got.config
        assert config == (want.static() if isinstance(want, AutoSpec) else want)
    assert args.max_len == 777 and args.serve == (serve is not None)
    if serve:
        assert batch_config(args) == serve


def test_a_background_build_runs_idle_and_a_measurement_started_meanwhile_says_so(tmp_path, monkeypatch, capsys):
    """The detached build runs in the idle scheduling class (every thread and compiler it starts inherits it), and
    `bench`, `sweep` and `tune` started while a build holds the store's lock say so first, naming its pid; the run's
    fingerprint records it, and `compare` ranks it as a difference that matters."""
    from specdecode.bench.fingerprint import capture, diff
    from specdecode.runtime import session

    child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"], capture_output=True,
                           text=True, preexec_fn=background.lowest_priority, check=True)
    assert int(child.stdout) == getattr(os, "SCHED_IDLE", -1)

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert background.running_build() is None and background.build_warning() is None

    def stop(*args, **kwargs):
        raise ValueError("stopped before loading")

    monkeypatch.setattr(session, "load_model", stop)
    idle = capture(threads=1, dtype="float32", device="cpu")
    with background.build_lock(tmp_path / "graphs"):
        assert background.running_build() == os.getpid()
        for argv in (["bench", "--no-store"], ["sweep", "--no-store"], ["bench", "--concurrency", "1,2", "--no-store"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.index("compiled graphs are being built (pid") < err.index("stopped before loading"), err
        busy = capture(threads=1, dtype="float32", device="cpu")
    assert busy["graph_build_running"] and not idle["graph_build_running"]
    assert any(d.label == "graph build running" and d.impact == 3 for d in diff(idle, busy))
    assert background.running_build() is None


def test_constants_inductor_makes_go_with_a_package_without_weights(tmp_path):
    """Inductor lowers a 4-bit matmul (``aten._weight_int4pack_mm_for_cpu``, the kernel plan's int4pack) with its
    group size as a constant of its own. A package without weights holds none of its constants: the build
    records that one in the package and the loader binds it beside the module's tensors (on an AVX2 EPYC, whose
    kernel plan takes int4pack, every 4-bit target graph had been refused for lacking it). Equal to eager."""
    q = torch.randint(0, 16, (32, 64), dtype=torch.int32)

    class Int4(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("sz", torch.rand(2, 32, 2, dtype=torch.bfloat16))

        def forward(self, x):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, 32, self.sz)

    module, x = Int4(), torch.randn(1, 64, dtype=torch.bfloat16)
    path = tmp_path / "int4.pt2"
    with torch.no_grad():
        graphstore.aoti_package(torch.export.export(module, (x,)), path, bound=True, held=[])
    literals = graphstore.read_literals(path)
    assert literals and all(t.dtype == torch.int64 and t.item() == 32 for t in literals.values())
    graph = graphstore.LoadedGraph(path, dict(module.named_buffers()))
    assert torch.equal(graph(x), module(x))
