"""The console script end to end on the real default model."""

import json

import pytest

from tests.helpers import run_specdecode

pytestmark = pytest.mark.model


specdecode = run_specdecode


def test_generate_json():
    out = specdecode("generate", "What is the capital of France?", "--json", "--max-new-tokens", "24",
                     "--threads", "2")
    record = json.loads(out.stdout)
    for key in ("text", "token_ids", "num_tokens", "elapsed_s", "tok_per_s", "threads", "dtype", "weights"):
        assert key in record
    assert "Paris" in record["text"]
    assert record["num_tokens"] == len(record["token_ids"]) <= 24
    assert record["threads"] == 2


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_generate_with_reduced_weights(weights):  # q4: what scripts/demo.sh runs
    out = specdecode("generate", "What is the capital of France?", "--json", "--max-new-tokens", "12",
                     "--dtype", "bfloat16", "--weights", weights, "--threads", "2")
    record = json.loads(out.stdout)
    assert record["weights"] == weights and record["num_tokens"] >= 1 and "Paris" in record["text"]
    assert record["kernels"]["mode"] == "auto" and record["kernels"]["choices"]


def test_generate_stream_raw_and_summary():
    out = specdecode("generate", "The capital of France is", "--raw", "--stream", "--max-new-tokens", "8")
    assert out.stdout.strip()
    assert "tok/s" in out.stderr


def test_bad_model_path_is_a_clear_error(tmp_path):
    out = specdecode("generate", "hi", "--model", str(tmp_path / "missing.gguf"), check=False)
    assert out.returncode == 2
    assert "missing.gguf: no such file or directory" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_sampling_args_are_clear_errors():
    out = specdecode("generate", "hi", "--top-p", "0", check=False)
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr


@pytest.mark.parametrize("flags, named", [(["--num-steps", "3"], "--num-steps"),
                                          (["--topk", "2", "--adapt"], "--topk, --adapt"),
                                          (["--ngram", "4", "--verify-budget"], "--ngram, --verify-budget")])
def test_shape_flags_beside_no_spec_are_refused_not_ignored(flags, named):
    out = specdecode("generate", "hi", "--no-spec", *flags, check=False)
    assert out.returncode == 2 and f"so {named} would do nothing" in out.stderr


def test_export_takes_no_runtime_flags():
    """It reads the target in float32 on the CPU: --dtype and the like were accepted and unused."""
    out = specdecode("export", "--format", "vllm", "--out", "x", "--dtype", "bfloat16", check=False)
    assert out.returncode == 2 and "unrecognized arguments: --dtype" in out.stderr


def test_bench_writes_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "category": "greet"}\n'
                       '{"turns": ["Name a color."], "category": "qa"}\n')
    out_file = tmp_path / "bench.json"
    specdecode("bench", "--methods", "baseline", "--prompts", str(prompts), "--max-new-tokens", "8",
               "--warmup", "0", "--out", str(out_file), "--op-profile")
    result = json.loads(out_file.read_text())
    assert result["summary"][0]["method"] == "baseline"
    assert result["summary"][0]["outputs_match_baseline"] == "2/2"
    assert len(result["records"]) == 2 and result["fingerprint"]["threads"] >= 1
    assert result["op_profile"] and "::" in result["op_profile"][0]["op"]  # aten:: or mkldnn:: (packed kernels)


def test_bench_eagle3_methods_and_categories(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "category": "greet"}\n'
                       '{"turns": ["Name a color."], "category": "qa"}\n')
    out_file = tmp_path / "bench.json"
    specdecode("bench", "--methods", "baseline,eagle3:steps=2,topk=1,eagle3:steps=2,topk=2,draft_tokens=4",
               "--drafter", "random", "--prompts", str(prompts), "--max-new-tokens", "8", "--warmup", "0",
               "--dtype", "float32", "--out", str(out_file))  # float32: speculative == baseline is a guarantee
    result = json.loads(out_file.read_text())  # (in bf16, the default on a CPU with avx512_bf16, near-ties may flip)
    names = [row["method"] for row in result["summary"]]
    assert names == ["baseline", "eagle3:steps=2,topk=1", "eagle3:steps=2,topk=2,draft_tokens=4"]
    for row in result["summary"][1:]:
        assert row["outputs_match_baseline"] == "2/2"
        assert row["accept_length"] >= 1.0
    assert set(result["by_category"]) == {"greet", "qa"}


def test_generate_with_random_drafter_json_has_spec_fields():
    out = specdecode("generate", "Hi", "--drafter", "random", "--num-steps", "2", "--json", "--max-new-tokens", "12",
                     "--profile")
    record = json.loads(out.stdout)
    for key in ("accept_length", "accept_rate", "per_position_accept", "phases"):
        assert key in record
    assert set(record["phases"]) == {"draft", "verify", "allreduce", "extend", "other"}
    assert record["phases"]["allreduce"]["ms_per_cycle"] == 0  # one process: no collectives
    assert "EAGLE3 profile" in out.stderr and "Target verify" in out.stderr


def test_a_run_without_stored_graphs_says_what_happens_next(monkeypatch, capsys, tmp_path):
    """A new user got eager steps and was never told that `specdecode compile` exists: now the run says
    its graphs are built in the background after it (and how to build them in the foreground), then
    starts that build, detached, and says where its output goes."""
    from specdecode.cli.main import main
    from specdecode.runtime import background, builds, graphstore
    from specdecode.runtime.graphstore import PackageStore

    monkeypatch.setattr(PackageStore, "count", lambda self, model: 0)  # this machine has stored none
    monkeypatch.setattr(graphstore, "cache_root", lambda: tmp_path)  # the graph store's, not the kernel plans'
    monkeypatch.setenv(background.BACKGROUND_ENV, "1")
    started: list = []
    monkeypatch.setattr(builds, "build_in_background", lambda argv, root: started.append((argv, root))
                        or background.BackgroundBuild(7, "started", root / "build.log"))
    assert main(["generate", "Hi", "--no-spec", "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "the steps run eager" in err and "built in the background" in err and "specdecode compile" in err
    assert "building the graphs this run ran eager in the background (pid 7" in err and "build.log" in err
    (argv, root), = started  # the plain set, in the format this run resolved
    assert argv[-3:] == ["--no-spec", "--compile-max-len", "1024"] and root == tmp_path / "graphs"


def test_profile_of_a_plain_run_says_why_it_has_no_table():
    """The quick start decodes plain where auto predicts no shape pays: --profile printed nothing then."""
    out = specdecode("generate", "Hi", "--no-spec", "--profile", "--max-new-tokens", "4")
    assert "profile: no speculative phases to time: this run decoded plain" in out.stderr
    assert "ms a token after the first" in out.stderr and "drop --no-spec" in out.stderr


def test_mismatched_drafter_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}')
    out = specdecode("generate", "Hi", "--drafter", str(tmp_path), check=False)
    assert out.returncode == 2 and "LlamaForCausalLMEagle3" in out.stderr and "Traceback" not in out.stderr


def test_sweep_reports_configs_cost_model_and_plots(tmp_path):
    out = tmp_path / "sweep"
    specdecode("sweep", "--num-steps", "1,2,3", "--topk", "1,2", "--drafter", "random", "--num-prompts", "2",
               "--max-new-tokens", "8", "--warmup", "0", "--out", str(out))
    result = json.loads((out / "sweep.json").read_text())
    methods = [c["method"] for c in result["configs"]]
    assert "eagle3:steps=3,topk=1" in methods and "eagle3:steps=2,topk=2,draft_tokens=5" in methods
    assert result["best"] in methods
    assert set(result["verify_ms_by_tokens"]) >= {"2", "3", "4"}
    chain = next(c for c in result["configs"] if c["method"] == "eagle3:steps=2,topk=1")
    assert chain["predicted_speedup"] > 0 and chain["outputs_match_baseline"] == "2/2"
    tree = next(c for c in result["configs"] if c["method"] == "eagle3:steps=2,topk=2,draft_tokens=5")
    assert tree["predicted_speedup"] > 0 and tree["predicted_accept_length"] >= 1
    for name in ("tok_s_vs_steps.png", "phase_breakdown.png", "verify_ms_vs_tokens.png",
                 "acceptance_by_position.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_sweep_over_dtypes_and_threads(tmp_path):
    out = tmp_path / "sweep"
    proc = specdecode("sweep", "--num-steps", "1,2", "--drafter", "random", "--num-prompts", "1",
                      "--max-new-tokens", "4", "--warmup", "0", "--dtypes", "float32,bfloat16", "--threads-grid",
                      "1,2", "--out", str(out))
    for sub in ("float32-1t", "float32-2t", "bfloat16-1t", "bfloat16-2t"):
        result = json.loads((out / sub / "sweep.json").read_text())
        assert result["dtype"] == sub.split("-")[0] and result["threads"] == int(sub[-2])
        assert result["fingerprint"]["threads"] == int(sub[-2])
    assert "best configuration per setting" in proc.stdout and "fastest overall" in proc.stderr


def test_check_reports_agreement_with_the_dtype_tolerance(tmp_path):
    """`check` in bf16: judged against bf16's measured tolerance, with the agreement summary."""
    out_file = tmp_path / "check.json"
    out = specdecode("check", "--dtype", "bfloat16", "--num-prompts", "2", "--max-new-tokens", "12",
                     "--out", str(out_file))
    result = json.loads(out_file.read_text())
    a = result["agreement"]
    assert result["dtype"] == "bfloat16" and a["tolerance"] == 0.5 and a["prompts"] == 2
    assert a["identical"] == sum(r["identical"] for r in result["rows"]) and a["above_tolerance"] == 0
    assert f"{a['identical']}/2 prompts identical" in out.stderr


def test_version():
    from importlib.metadata import version

    out = run_specdecode("--version")
    assert out.stdout.strip() == f"specdecode {version('specdecode')}"


@pytest.mark.parametrize("methods, words", [("baseline,eagle4", "unknown method 'eagle4'"),
                                            ("baseline:compile=maybe", "compile must be on or off"),
                                            ("eagle3:steps=x", "must be integers"),
                                            ("served:model=m", "served:url=")])
def test_bench_refuses_a_bad_method_before_loading_anything(tmp_path, methods, words):
    """Checked before the model loads: an empty cache stays empty (no native build, no kernel plan)."""
    cache = tmp_path / "cache"
    out = run_specdecode("bench", "--methods", methods, "--no-store", env={"SPECDECODE_CACHE": str(cache)},
                         check=False)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr
    assert not cache.exists() or not any(cache.iterdir())


def test_paths_under_a_file_and_a_closed_pipe_are_one_line_errors(tmp_path):
    """No traceback: SPECDECODE_CACHE or runs --store under a regular file, and `generate --stream | head`."""
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_specdecode("generate", "Hi", "--max-new-tokens", "2", env={"SPECDECODE_CACHE": str(blocker / "c")},
                         check=False)
    assert out.returncode == 2 and "cannot be written (Not a directory)" in out.stderr and "Traceback" not in out.stderr
    out = run_specdecode("runs", "--store", str(blocker / "x.db"), check=False)
    assert out.returncode == 2 and "is a file where a directory is needed" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    proc = subprocess.Popen([sys.executable, "-m", "specdecode", "generate", "Tell a long story.", "--max-new-tokens",
                             "400", "--stream"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away, as `| head -c 1` does
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err
