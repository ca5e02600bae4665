"""Bench harness bookkeeping: fingerprints, redaction, diff ranking, the results store, compare,
launch profiles. (End-to-end runs on the real model are in test_harness_cli.py.)"""

import json
import multiprocessing
import os

import pytest

from specdecode.bench.compare import compare_runs
from specdecode.bench.fingerprint import REDACTED, capture, diff, filtered_env, performance_relevant, redact_argv
from specdecode.bench.profiles import LaunchProfile, load_profile, save_profile
from specdecode.bench.stats import permutation_p, sign_flip_p
from specdecode.bench.store import ResultsStore, Run, append_jsonl, load_run, new_run_id, read_jsonl
from specdecode.bench.tune import grid_points, parse_env_grid
from specdecode.io.paths import file_hash


def test_fingerprint_captures_what_speed_depends_on(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NCCL_PROTO", "LL")
    monkeypatch.setenv("SOME_UNRELATED_VAR", "x")
    model = tmp_path / "m.bin"
    model.write_bytes(b"weights")
    fp = capture(threads=2, dtype="bfloat16", device="cpu", model_path=model, argv=["specdecode", "bench"])
    assert fp["env"]["OMP_NUM_THREADS"] == "3" and fp["env"]["NCCL_PROTO"] == "LL"
    assert "SOME_UNRELATED_VAR" not in fp["env"]
    assert fp["threads"] == 2 and fp["dtype"] == "bfloat16" and fp["interop_threads"] >= 1
    assert fp["cpu"]["model"] and fp["cpu"]["affinity_count"] >= 1 and fp["cpu"]["logical_cores"] >= 1
    assert fp["cpu"]["loadavg_1m"] is not None
    assert fp["versions"]["torch"] and fp["versions"]["python"]
    assert fp["gpu"] is None  # CPU-only machines record no GPU rather than inventing one
    assert fp["model"]["sha256"] == file_hash(model)
    assert fp["argv"] == ["specdecode", "bench"]
    json.dumps(fp)  # storable as is


def test_file_hash_follows_content(tmp_path):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"a" * 1000)
    h1 = file_hash(d)
    assert h1 == file_hash(d) and len(h1) == 16
    (d / "model.safetensors").write_bytes(b"b" * 1000)
    assert file_hash(d) != h1
    assert file_hash(tmp_path / "missing") is None


def test_secrets_are_redacted():
    env = filtered_env({
        "NCCL_PROTO": "LL", "SPECDECODE_API_KEY": "abc", "CUDA_TOKEN_FILE": "/x", "TORCH_HUB_URL": "https://u:pw@h/",
        "OMP_SOMETHING": "hf_" + "a" * 30, "NCCL_SOCKET_IFNAME": "eth0", "AWS_SECRET_ACCESS_KEY": "zzz",
        "PATH": "/usr/bin"})
    assert env["NCCL_PROTO"] == "LL" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["SPECDECODE_API_KEY"] == env["CUDA_TOKEN_FILE"] == env["TORCH_HUB_URL"] == REDACTED
    assert env["OMP_SOMETHING"] == REDACTED
    assert "AWS_SECRET_ACCESS_KEY" not in env and "PATH" not in env
    argv = redact_argv(["serve", "--api-key", "s3cret", "--hf-token=abc", "--port", "8000", "sk-" + "x" * 20])
    assert argv == ["serve", "--api-key", REDACTED, f"--hf-token={REDACTED}", "--port", "8000", REDACTED]


def _fp(**changes):
    base = {"threads": 2, "interop_threads": 2, "dtype": "bfloat16", "device": "cpu",
            "versions": {"python": "3.11.9", "torch": "2.13.0"}, "cpu": {"model": "EPYC", "affinity_count": 2,
                                                                     "loadavg_1m": 0.2},
            "env": {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "MASTER_PORT": "29500"}, "hostname": "a",
            "git_commit": "abc", "model": {"sha256": "m1"}, "drafter": {"sha256": "d1"}}
    for k, v in changes.items():
        base[k] = v
    return base


def test_diff_ranks_by_likely_impact():
    a = _fp()
    b = _fp(threads=1, env={"NCCL_ALGO": "Ring", "MASTER_PORT": "29600"}, hostname="b",
            versions={"python": "3.11.10", "torch": "2.13.0"}, cpu={"model": "EPYC", "affinity_count": 2,
                                                                   "loadavg_1m": 1.9})
    diffs = diff(a, b)
    labels = [d.label for d in diffs]
    high = {"NCCL_PROTO", "torch threads"}
    assert set(labels[:2]) == high  # the two high-impact changes lead
    assert str(next(d for d in diffs if d.label == "NCCL_PROTO")) == "NCCL_PROTO: LL -> (unset)"
    assert str(next(d for d in diffs if d.label == "torch threads")) == "torch threads: 2 -> 1"
    assert labels.index("load average (1 min)") < labels.index("python version") < labels.index("MASTER_PORT")
    assert "MASTER_PORT" not in {d.label for d in performance_relevant(diffs)}
    assert diff(a, _fp()) == []
    small_load = _fp(cpu={"model": "EPYC", "affinity_count": 2, "loadavg_1m": 0.4})
    assert diff(a, small_load) == []  # 0.2 vs 0.4: noise, not a difference


def _run(run_id, speeds: dict[str, list[float]], fp=None, accept=None):
    records = [{"method": m, "run": 0, "prompt_id": f"p{i}", "category": "c", "tok_per_s": v}
               for m, vs in speeds.items() for i, v in enumerate(vs)]
    summary = [{"method": m, "tok_per_s_median": sorted(vs)[len(vs) // 2]} | (
        {"accept_length": accept} if accept and m != "baseline" else {}) for m, vs in speeds.items()]
    return Run(run_id, "bench", "2026-11-30 10:00:00", fp or _fp(), summary, records)


def test_compare_names_the_changed_variable_first():
    fast = [50, 52, 48, 51, 49, 53, 50, 47]
    a = _run("A", {"baseline": fast})
    b = _run("B", {"baseline": [v * 0.7 for v in fast]}, fp=_fp(env={"NCCL_ALGO": "Ring", "MASTER_PORT": "29500"}))
    cmp = compare_runs(a, b)
    m = cmp.methods[0]
    assert m.paired and abs(m.ratio - 0.7) < 1e-9 and m.p_value <= 2 / 256 and m.changed
    headline = cmp.headline()
    assert headline[0].startswith("RESULTS DIFFER BEYOND NOISE") and "NCCL_PROTO: LL -> (unset)" in headline[1]

    assert m.same_output is None  # no token ids recorded
    same = compare_runs(a, _run("C", {"baseline": [v * (1.01 if i % 2 else 0.99) for i, v in enumerate(fast)]}))
    assert not same.methods[0].changed and same.headline()[0].startswith("No change beyond noise; environments")


def test_compare_says_when_too_few_prompts_to_test():
    a = _run("A", {"baseline": [50, 52, 48, 51]})
    b = _run("B", {"baseline": [10, 11, 9, 10]}, fp=_fp(threads=1))
    cmp = compare_runs(a, b)
    assert not cmp.methods[0].testable and cmp.methods[0].verdict == "too few prompts to test"
    assert cmp.headline()[0].startswith("Too few prompts") and "torch threads: 2 -> 1" in cmp.headline()[0]


def test_compare_counts_identical_outputs():
    a = _run("A", {"baseline": [50, 51]})
    b = _run("B", {"baseline": [50, 51]})
    for r, ids in zip(a.records, ([1, 2, 3], [4, 5]), strict=True):
        r["token_ids"] = ids
    for r, ids in zip(b.records, ([1, 2, 3], [4, 6]), strict=True):
        r["token_ids"] = ids
    assert compare_runs(a, b).methods[0].same_output == "1/2"


def test_compare_unpaired_and_tests_can_detect_and_reject():
    assert sign_flip_p([0.1] * 10) == pytest.approx(2 / 1024)
    assert sign_flip_p([0.1, -0.1] * 5) == 1.0
    assert permutation_p([1.0, 1.1, 0.9, 1.0] * 3, [2.0, 2.1, 1.9, 2.0] * 3) < 0.01
    assert permutation_p([1.0, 1.1, 0.9, 1.0] * 3, [1.0, 1.1, 0.9, 1.0] * 3) > 0.5
    a = _run("A", {"baseline": [50, 51, 49, 50, 52, 48]})
    b = Run("B", "bench", "", _fp(), a.summary, [r | {"prompt_id": "q" + r["prompt_id"]} for r in a.records])
    assert not compare_runs(a, b).methods[0].paired


def _write_runs(args):
    db, jsonl, worker, n = args
    store = ResultsStore(db)
    for i in range(n):
        run = Run(f"w{worker}-{i}-{new_run_id()}", "bench", "2026-11-30", {"worker": worker}, [{"method": "x"}],
                  [{"method": "x", "i": j, "pad": "y" * 2000} for j in range(20)])
        store.save(run)
        append_jsonl(jsonl, run)


def test_concurrent_writers_lose_nothing(tmp_path):
    db, jsonl = tmp_path / "r.db", tmp_path / "r.jsonl"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        pool.map(_write_runs, [(db, jsonl, w, 8) for w in range(4)])
    store = ResultsStore(db)
    runs = store.list_runs(limit=100)
    assert len(runs) == 32
    for r in runs:
        assert len(store.load(r["run_id"]).records) == 20
    from_file = read_jsonl(jsonl)
    assert len(from_file) == 32 and all(len(r.records) == 20 for r in from_file)
    assert all(rec["i"] == j for r in from_file for j, rec in enumerate(r.records))


def test_run_references(tmp_path):
    store = ResultsStore(tmp_path / "r.db")
    for rid in ("20261130-100000-aaaaaa", "20261130-110000-aabbbb", "20261130-120000-cccccc"):
        store.save(Run(rid, "bench", rid[:15], {}, [{"method": "baseline"}], [{"method": "baseline"}]))
    assert store.resolve("latest") == "20261130-120000-cccccc"
    assert store.resolve("20261130-11") == "20261130-110000-aabbbb"
    with pytest.raises(ValueError, match="ambiguous"):
        store.resolve("20261130-1")
    with pytest.raises(ValueError, match="no run 'nope'"):
        store.resolve("nope")
    jsonl = tmp_path / "r.jsonl"
    append_jsonl(jsonl, store.load("latest"))
    append_jsonl(jsonl, store.load("20261130-10"))
    assert load_run(str(jsonl)).run_id == "20261130-100000-aaaaaa"  # the last one appended
    assert load_run(f"{jsonl}#20261130-12", store).run_id == "20261130-120000-cccccc"
    with pytest.raises(FileNotFoundError):
        load_run(str(tmp_path / "missing.jsonl"), store)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        load_run(str(bad), store)
    not_db = tmp_path / "not.db"
    not_db.write_text("hello, I am not SQLite" * 100)
    with pytest.raises(ValueError, match="not a specdecode results store"):
        ResultsStore(not_db).list_runs()


def test_launch_profile_roundtrip_and_contradictions(tmp_path):
    p = LaunchProfile("fast-2t", {"OMP_NUM_THREADS": "2", "NCCL_PROTO": "", "KMP_BLOCKTIME": "0"},
                      'tuned "quoted" \\ description', extra={"tok_per_s": 54.1})
    path = save_profile(p, str(tmp_path / "fast-2t.toml"))
    q = load_profile(str(path))
    assert (q.name, q.env, q.description, q.extra) == (p.name, p.env, p.description, {"tok_per_s": 54.1})
    env = q.apply_to({"NCCL_PROTO": "LL", "HOME": "/h"})
    assert env == {"OMP_NUM_THREADS": "2", "KMP_BLOCKTIME": "0", "HOME": "/h"}
    assert q.contradictions(env, threads=2) == []
    bad = q.contradictions({"OMP_NUM_THREADS": "1", "NCCL_PROTO": "LL", "KMP_BLOCKTIME": "0"}, threads=4)
    assert bad == ["NCCL_PROTO: profile (unset), live LL", "OMP_NUM_THREADS: profile 2, live 1",
                   "torch threads: profile OMP_NUM_THREADS=2, live 4 (--threads or SPECDECODE_THREADS overrides it)"]
    with pytest.raises(ValueError, match="not found"):
        load_profile("no-such-profile")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [unclosed")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_profile(str(broken))


def test_tune_grid_parsing():
    axes = parse_env_grid(["OMP_NUM_THREADS=1,2", "NCCL_PROTO=LL,Simple,unset"])
    points = grid_points(axes)
    assert len(points) == 6 and {"OMP_NUM_THREADS": "2", "NCCL_PROTO": None} in points
    for bad in (["OMP_NUM_THREADS"], ["=1,2"], ["A-B=1"], ["X=1", "X=2"]):
        with pytest.raises(ValueError):
            parse_env_grid(bad)


def test_redacted_values_never_reach_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_API_KEY", "topsecret-value")
    fp = capture(threads=1, dtype="float32", device="cpu", argv=["serve", "--api-key", "topsecret-value"])
    store = ResultsStore(tmp_path / "r.db")
    store.save(Run("r1", "bench", "", fp, [], []))
    assert b"topsecret-value" not in (tmp_path / "r.db").read_bytes()
    assert "topsecret-value" not in json.dumps(fp)
    assert os.environ["SPECDECODE_API_KEY"] == "topsecret-value"  # redaction does not touch the live env


def test_report_markdown_and_html(tmp_path):
    from specdecode.cli.main import main

    store = ResultsStore(tmp_path / "r.db")
    a = _run("20261130-100000-aaaaaa", {"baseline": [50, 52, 48, 51, 49, 53], "eagle3:steps=2": [60] * 6},
             accept=1.6)
    b = _run("20261130-110000-bbbbbb", {"baseline": [35, 36, 34, 35, 36, 33], "eagle3:steps=2": [42] * 6},
             fp=_fp(threads=1), accept=1.6)
    for r in (a, b):
        r.summary = [s | {"tok_per_s_min": 30.0, "tok_per_s_max": 60.0} for s in r.summary]
        r.meta = {"by_category": {"c": r.summary}, "max_new_tokens": 64}
        store.save(r)
    md = tmp_path / "out" / "report.md"
    assert main(["report", a.run_id, b.run_id, "--store", str(store.path), "--out", str(md)]) == 0
    text = md.read_text()
    assert "RESULTS DIFFER BEYOND NOISE" in text and "torch threads" in text
    assert "| eagle3:steps=2 |" in text and "1.60" in text
    pngs = list((tmp_path / "out" / "report-files").glob("*.png"))
    assert len(pngs) == 2 and all(f"report-files/{p.name}" in text for p in pngs)
    page = tmp_path / "report.html"
    assert main(["report", "latest", "--store", str(store.path), "--out", str(page)]) == 0
    html_text = page.read_text()
    assert html_text.startswith("<!doctype html>") and "data:image/png;base64," in html_text
    assert main(["report", "nope", "--store", str(store.path), "--out", str(page)]) == 2
